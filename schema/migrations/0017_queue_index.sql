-- A pool's queues (`queue.configured` on its stream) are read by every
-- change of a queue and every request that names one; the pool's stream
-- also holds every placement, so they are found through this small partial
-- index rather than a scan of the stream. Built once over the existing log
-- (appends wait while it is: seconds per ten million events).
CREATE INDEX IF NOT EXISTS events_queue_configured
    ON strata.events (stream, position)
 WHERE type = 'queue.configured';
