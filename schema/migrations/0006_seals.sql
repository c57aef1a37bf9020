-- Seals: a hash chain over a partition's rows in position order. Each row's
-- digest is SHA-256 over its columns' text; the chain is
-- chain_i = SHA-256(chain_{i-1} || digest_i). Segments of 1,000 rows keep
-- the first 8 bytes of every row's digest, so verification can name the
-- first altered, inserted or deleted row, not only say that something changed.
CREATE TABLE strata.seals (
    partition      text        PRIMARY KEY,
    first_position bigint,
    last_position  bigint,
    rows           bigint      NOT NULL,
    chain          bytea       NOT NULL,
    sealed_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE strata.seal_segments (
    partition      text    NOT NULL REFERENCES strata.seals (partition) ON DELETE CASCADE,
    segment        integer NOT NULL,
    first_position bigint  NOT NULL,
    positions      bigint[] NOT NULL,
    digests        bytea   NOT NULL,
    chain          bytea   NOT NULL,
    PRIMARY KEY (partition, segment)
);
