"""Alembic migrations of the SPACE schema."""
