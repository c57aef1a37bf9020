-- Positions are never handed out twice, even when an asynchronous standby
-- that missed the primary's last commits takes over. The new primary's
-- `log_head` is where the standby had got to; the old primary may have
-- handed out positions past it, which consumers have seen. So the first
-- append on a new timeline (a promotion, a point-in-time recovery) moves the
-- head to the start of that timeline's epoch: `(timeline - 1) << 40`, one
-- epoch of 2^40 positions per timeline. Positions stay contiguous within an
-- epoch; the one jump between epochs is recorded here, with the head the new
-- timeline began from (what the standby had; anything between it and the
-- epoch's start that a consumer saw came from the old primary and is lost).
ALTER TABLE strata.log_head
    ADD COLUMN timeline integer,
    ADD COLUMN epoch_from bigint;

CREATE TABLE strata.log_epochs (
    first_position bigint      PRIMARY KEY,
    previous_head  bigint      NOT NULL,
    timeline       integer     NOT NULL,
    started_at     timestamptz NOT NULL DEFAULT now()
);
