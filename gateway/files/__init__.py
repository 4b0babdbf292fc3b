"""The Files API (/v1/files): uploads checked line by line, kept per tenant within its storage
quota, their bytes in a local directory or an S3-compatible object store."""
