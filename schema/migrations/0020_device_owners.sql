-- Which node reports each GPU, by the GPU's hardware id: a GPU is in one
-- node at a time, so a node that reports another node's GPU as its own (a
-- forged or misconfigured daemon) is refused where the log is written, in
-- the appending transaction, whoever writes it.
--
-- Only hardware ids are region-wide: NVML's `GPU-<uuid>` and
-- `MIG-<uuid>` (a fake device set's ids take the same form). Names such
-- as `gpu0`, which simulated fleets seed, are a node's own and never
-- collide across nodes. A node's rows are replaced by each inventory it
-- reports and removed when it leaves the pool (`node.left`), so a GPU that
-- moved to another node is taken there once the first node leaves or
-- reports its inventory without it.
CREATE TABLE strata.device_owners (
    device text PRIMARY KEY,
    node   text NOT NULL
);
CREATE INDEX device_owners_node ON strata.device_owners (node);

-- Whether `id` is a hardware id, unique in the region.
CREATE FUNCTION strata.is_hardware_device_id(id text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT id LIKE 'GPU-%' OR id LIKE 'MIG-%'
$$;

CREATE FUNCTION strata.track_device_owners() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    n      text := NEW.payload->>'node';
    d      text;
    holder text;
BEGIN
    DELETE FROM strata.device_owners WHERE node = n;
    IF NEW.type = 'node.left' THEN
        RETURN NULL;
    END IF;
    FOR d IN SELECT e->>'id' FROM jsonb_array_elements(NEW.payload->'devices') e
             WHERE strata.is_hardware_device_id(e->>'id')
    LOOP
        INSERT INTO strata.device_owners (device, node) VALUES (d, n)
        ON CONFLICT (device) DO NOTHING;
        IF NOT FOUND THEN
            SELECT o.node INTO holder FROM strata.device_owners o WHERE o.device = d;
            RAISE EXCEPTION 'node % reports device %, which node % reports', n, d, holder
                USING ERRCODE = 'unique_violation',
                      HINT = 'a GPU is in one node at a time: if it moved, the node that had it leaves the pool or reports its inventory without it first';
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

CREATE TRIGGER device_owners AFTER INSERT ON strata.events
    FOR EACH ROW
    WHEN (NEW.type IN ('node.joined', 'node.inventory_reported', 'node.left'))
    EXECUTE FUNCTION strata.track_device_owners();

-- The owners as the log stands: each node's latest inventory, unless it
-- left since. A region whose log already holds a GPU on two nodes keeps
-- the first node's claim (by position); the second is refused at its next
-- report.
INSERT INTO strata.device_owners (device, node)
SELECT d->>'id', latest.node
  FROM (SELECT DISTINCT ON (payload->>'node') payload->>'node' AS node, type, payload, position
          FROM strata.events
         WHERE type IN ('node.joined', 'node.inventory_reported', 'node.left',
                        'NodeJoined', 'InventoryReported', 'NodeLeft')
         ORDER BY payload->>'node', position DESC) latest,
       jsonb_array_elements(CASE WHEN latest.type IN ('node.left', 'NodeLeft') THEN '[]'::jsonb
                                 ELSE latest.payload->'devices' END) d
 WHERE strata.is_hardware_device_id(d->>'id')
 ORDER BY latest.position
ON CONFLICT (device) DO NOTHING;
