-- Stream names are identifiers: compare them byte by byte. Under a
-- non-"C" default collation (C.UTF-8, en_US.UTF-8, ...) every comparison in
-- the streams key and the events (stream, version) index goes through the
-- C library's strcoll; with "C" it is a memcmp. Appends probe both on every
-- event. The order of stream names becomes byte order everywhere.
ALTER TABLE strata.streams ALTER COLUMN stream TYPE text COLLATE "C";
ALTER TABLE strata.events ALTER COLUMN stream TYPE text COLLATE "C";
