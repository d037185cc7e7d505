"""The gateway's store: where files, batches, keys and the audit log live (SQLite embedded,
PostgreSQL shared by several replicas), behind one small database interface."""
