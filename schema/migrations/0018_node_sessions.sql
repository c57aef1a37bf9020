-- Which gateway holds each node's session, kept by the database as the
-- node streams' events are appended (in the appending transaction), so a
-- gateway that dies or freezes leaves its nodes findable: another gateway
-- marks them lost once the dead one's lease (`gateway/<id>`) has expired or
-- belongs to a newer incarnation. A row says whether the pool last heard
-- the node was in contact (`in_contact`), so a node already marked lost is
-- not marked again. The marking itself is fenced by the node stream's
-- version; this table only finds the candidates.
CREATE TABLE strata.node_sessions (
    node          text    PRIMARY KEY,
    pool          text    NOT NULL,
    gateway       text    NOT NULL,
    gateway_epoch bigint  NOT NULL,
    in_contact    boolean NOT NULL
);

CREATE FUNCTION strata.track_node_session() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.type = 'node.session_opened' THEN
        -- Sessions opened by gateways older than this table name no pool:
        -- they are tracked from the node's next session.
        IF NEW.payload ? 'pool' AND NEW.payload ? 'gateway_epoch' THEN
            INSERT INTO strata.node_sessions AS s (node, pool, gateway, gateway_epoch, in_contact)
            VALUES (NEW.payload->>'node', NEW.payload->>'pool', NEW.payload->>'gateway',
                    (NEW.payload->>'gateway_epoch')::bigint, true)
            ON CONFLICT (node) DO UPDATE
               SET pool = EXCLUDED.pool, gateway = EXCLUDED.gateway,
                   gateway_epoch = EXCLUDED.gateway_epoch, in_contact = true;
        END IF;
    ELSIF NEW.type = 'node.marked_reachable' THEN
        UPDATE strata.node_sessions SET in_contact = true WHERE node = NEW.payload->>'node';
    ELSE
        UPDATE strata.node_sessions SET in_contact = false WHERE node = NEW.payload->>'node';
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER node_sessions AFTER INSERT ON strata.events
    FOR EACH ROW
    WHEN (NEW.type IN ('node.session_opened', 'node.marked_reachable', 'node.disconnected',
                       'node.marked_unreachable', 'node.session_expired', 'node.revoked'))
    EXECUTE FUNCTION strata.track_node_session();
