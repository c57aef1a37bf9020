//! Integration tests of the projections against a real Postgres.
