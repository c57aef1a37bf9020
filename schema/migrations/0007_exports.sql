-- Partition archives written by `strata partitions export`; retirement
-- requires one (with the sealed row count) before a month is dropped.
CREATE TABLE strata.partition_exports (
    partition   text        NOT NULL,
    path        text        NOT NULL,
    rows        bigint      NOT NULL,
    checksum    text        NOT NULL,
    exported_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (partition, exported_at)
);
