"""The public HTTP API: authentication, validation, intent into PostgreSQL, streams to workers."""
