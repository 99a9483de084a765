"""PostgreSQL, the system of record: tables, migrations, queries, and the embedded server."""
