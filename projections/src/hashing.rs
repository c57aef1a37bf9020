//! The hash maps of the index's derived state. They are keyed by names
//! (pools, classes, queues, racks, nodes) and looked up several times for
//! every device a batch books, so they hash with foldhash, seeded afresh in
//! every process, instead of the standard library's SipHash (13% of the
//! planner's instructions in the gauge's `plan` workload went to SipHash).
//! The keys come from operators and admitted nodes, and the state that is
//! kept and compared (pools, nodes, reservations) is in ordered maps.

/// A hash map with foldhash.
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
/// A hash set with foldhash.
pub type FastSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;
