-- Client certificates revoked before they expire: operators of the client
-- API (urn:strata:operator:NAME) and auditors of the audit endpoint
-- (urn:strata:auditor:NAME). Gateways and the audit endpoint refuse a
-- certificate whose serial is here. Each revocation is also written to the
-- log (`certificate.revoked` on operator/NAME, auditor/NAME or
-- certificate/SERIAL).
CREATE TABLE strata.revoked_certificates (
    -- Lowercase hex without leading zero bytes, as the CA writes it.
    serial     text        PRIMARY KEY CHECK (serial ~ '^[0-9a-f]{1,40}$'),
    -- Known when the certificate itself was given to `strata ca revoke`.
    kind       text        CHECK (kind IN ('operator', 'auditor')),
    name       text,
    not_after  timestamptz,
    reason     text        NOT NULL DEFAULT '',
    revoked_at timestamptz NOT NULL DEFAULT now()
);
