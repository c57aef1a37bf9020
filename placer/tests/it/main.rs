//! Integration tests of the placer against a real Postgres.
