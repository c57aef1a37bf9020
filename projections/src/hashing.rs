//! The hash maps of the index's derived state. They are keyed by names
//! (pools, classes, queues, racks, nodes) and looked up several times for
//! every device a batch books, so they hash with foldhash, seeded afresh in
//! every process, instead of the standard library's SipHash (13% of the
//! planner's instructions in the gauge's `plan` workload went to SipHash).
//! The pending and live reservations of the state are hashed too: the
//! planner looks each request up several times a batch (9% of its time in a
//! retry-heavy multi-tenant pool went to ordered lookups), and nothing reads
//! them in order. The keys are names that authenticated principals chose
//! (operators, admitted nodes, clients for their reservation ids), and the
//! seed is random per process, so a key set that collides cannot be
//! prepared in advance.

/// A hash map with foldhash.
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
/// A hash set with foldhash.
pub type FastSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;
