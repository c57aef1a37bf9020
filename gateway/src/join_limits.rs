//! What a join must pass before it costs a transaction and a signature, in
//! order: its address must not have tried too many bad tokens just before
//! (each bad one spends from the address's own bucket, so one address
//! flooding cannot slow another, and a fleet joining from behind one
//! address is not held up by good joins), a cheap check that its token is
//! one the region issued (the hashes of tokens not long expired, held in
//! memory and loaded again at most once a second on a miss), the token's
//! own bucket, and then the gateway's bucket for joins, which only tokens
//! the region issued spend. The database still decides whether the token
//! is good (`identity::redeem`).

use crate::bucket::Buckets;
use std::collections::HashSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// How often the known tokens are loaded again, at most, on a miss.
const RELOAD_AT_MOST_EVERY: Duration = Duration::from_secs(1);

/// The hashes of the region's join tokens, as last loaded.
#[derive(Default)]
pub(crate) struct KnownTokens {
    hashes: HashSet<Vec<u8>>,
    loaded_at: Option<Instant>,
}

impl KnownTokens {
    pub(crate) fn contains(&self, hash: &[u8]) -> bool {
        self.hashes.contains(hash)
    }

    /// How long until they may be loaded again (`None`: now).
    pub(crate) fn reload_in(&self, now: Instant) -> Option<Duration> {
        let next = self.loaded_at? + RELOAD_AT_MOST_EVERY;
        (next > now).then(|| next - now)
    }

    /// Whether they were loaded at or after `t`.
    pub(crate) fn loaded_since(&self, t: Instant) -> bool {
        self.loaded_at.is_some_and(|l| l >= t)
    }

    pub(crate) fn replace(&mut self, hashes: HashSet<Vec<u8>>, now: Instant) {
        self.hashes = hashes;
        self.loaded_at = Some(now);
    }
}

/// The per-address and per-token buckets of a gateway's joins.
#[derive(Default)]
pub(crate) struct JoinLimits {
    /// Bad tokens tried, per address.
    pub(crate) bad_per_source: Buckets<IpAddr>,
    pub(crate) per_token: Buckets<Vec<u8>>,
    pub(crate) known: tokio::sync::Mutex<KnownTokens>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_tokens_reload_at_most_once_a_second() {
        let mut k = KnownTokens::default();
        let now = Instant::now();
        assert_eq!(k.reload_in(now), None);
        assert!(!k.loaded_since(now));
        k.replace([vec![1u8]].into(), now);
        assert!(k.contains(&[1]) && !k.contains(&[2]));
        assert!(k.loaded_since(now));
        assert_eq!(
            k.reload_in(now + Duration::from_millis(400)),
            Some(Duration::from_millis(600))
        );
        assert_eq!(k.reload_in(now + RELOAD_AT_MOST_EVERY), None);
    }
}
