"""The Batches API (/v1/batches): a tenant's input file run line by line in the batch tier by
every replica's batch runner, its results in output and error files."""
