-- The certificate itself, so that a join whose answer was lost (the token
-- is spent, the certificate signed and recorded) can be answered again
-- when the same node asks with the same key.
ALTER TABLE strata.node_certificates ADD COLUMN certificate_pem text;
