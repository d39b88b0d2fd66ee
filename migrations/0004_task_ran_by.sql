-- quantd state, version 4: who ran a task. lease_owner names the holder only while the task is
-- LEASED ("worker:<name>" for a remote worker, "quantd:<pid>" for the daemon itself); ran_by keeps
-- the owner of the attempt that completed the task, or that failed it for good, written in the same
-- statement that ends the lease. A task requeued since keeps it until an attempt of its ends again.
-- Tasks that ended before this version have none (NULL).
ALTER TABLE tasks ADD COLUMN ran_by TEXT;
