-- Whether a replication reader holds what it decodes until the synchronous
-- standbys have it. Each reader reads `synchronous_standby_names` at the
-- start of its session and once per status interval, and records here what
-- it found, so an operator (and the region drill) can see when every reader
-- has taken a newly named standby into account before relying on it.
ALTER TABLE strata.replication_readers
    ADD COLUMN holds_for_standbys boolean NOT NULL DEFAULT false;
