-- A join token may name the one node it admits (`strata tokens create
-- --node`). Joining under an id that holds a valid certificate is refused,
-- and so is a revoked id, unless the token was made for that node: the
-- operator's explicit way of letting it back.
ALTER TABLE strata.join_tokens ADD COLUMN node text;
