"""The operator's side: the admin API under /admin/v1 (tenants, keys, audit log), the admin
credentials and roles that guard it, billing usage and exports, live read-outs of the
replica, and the admin console at /admin (its static files are in console/)."""
