//! Past usage that fades: a queue's GPU time, each millisecond of it
//! weighing half as much one half-life later.
//!
//! The index keeps one [`Decayed`] per queue and GPU class and carries it
//! forward only when what the queue holds changes (a placement, an ending)
//! or when its half-life does, to the time of that event: between two such
//! events the queue held a constant number of GPUs, so the carry is exact
//! in closed form. Everything is computed from the events' recorded times
//! with basic floating-point operations only (no library `exp`), so an index
//! rebuilt from the log, on any machine, holds the same bits as the live
//! one.

/// `ln 2`: a half-life over this is the decay's time constant.
const LN_2: f64 = std::f64::consts::LN_2;

/// GPU-milliseconds decayed to a moment.
#[derive(
    Debug, Clone, Copy, PartialEq, Default, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub struct Decayed {
    /// The sum over past GPU-milliseconds, each weighted `2^(-age/half-life)`.
    pub gpu_ms: f64,
    /// The moment it is decayed to (Unix ms).
    pub at_ms: u64,
}

impl Decayed {
    /// The value at `at_ms`, `held` GPUs having been held since `self.at_ms`
    /// (an earlier `at_ms` leaves it as it is: events' times may step back
    /// a little between transactions).
    pub fn carried(self, at_ms: u64, held: u64, half_life_ms: u64) -> Decayed {
        if at_ms <= self.at_ms {
            return self;
        }
        if held == 0 && self.gpu_ms == 0.0 {
            return Decayed { gpu_ms: 0.0, at_ms };
        }
        let d = halving(at_ms - self.at_ms, half_life_ms);
        let tau = half_life_ms as f64 / LN_2;
        Decayed {
            gpu_ms: self.gpu_ms * d + held as f64 * tau * (1.0 - d),
            at_ms,
        }
    }

    /// GPUs held on average over the recent past, weighted by the decay:
    /// what holding that many all along would have summed to.
    pub fn average(self, half_life_ms: u64) -> f64 {
        self.gpu_ms * LN_2 / half_life_ms.max(1) as f64
    }
}

/// `2^(-elapsed/half_life)`, from whole halvings and a series for the rest.
pub fn halving(elapsed_ms: u64, half_life_ms: u64) -> f64 {
    let h = half_life_ms.max(1);
    let whole = elapsed_ms / h;
    if whole >= 1022 {
        return 0.0;
    }
    let part = (elapsed_ms % h) as f64 / h as f64;
    // e^(-y) for y in [0, ln 2): the series' terms fall below 1e-17 by the
    // 20th.
    let y = part * LN_2;
    let (mut sum, mut term) = (1.0f64, 1.0f64);
    for k in 1..=20 {
        term *= -y / k as f64;
        sum += term;
        // The rest no longer moves the sum (a short step: a term or two).
        if term.abs() < 1e-17 {
            break;
        }
    }
    // 2^-whole exactly: a power of two built from its exponent.
    sum * f64::from_bits((1023 - whole) << 52)
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: u64 = 3_600_000;

    #[test]
    fn halving_follows_the_half_life() {
        assert_eq!(halving(0, H), 1.0);
        assert_eq!(halving(H, H), 0.5);
        assert_eq!(halving(3 * H, H), 0.125);
        assert!((halving(H / 2, H) - 0.5f64.sqrt()).abs() < 1e-15);
        assert!((halving(H + H / 3, H) - 2f64.powf(-4.0 / 3.0)).abs() < 1e-15);
        assert_eq!(halving(5000 * H, H), 0.0);
    }

    #[test]
    fn holding_gpus_fills_towards_their_count_and_fades_after() {
        // Held for a long time, the average is what was held.
        let full = Decayed::default().carried(200 * H, 8, H);
        assert!((full.average(H) - 8.0).abs() < 1e-9, "{full:?}");
        // One half-life after letting go, half of it.
        let after = full.carried(201 * H, 0, H);
        assert!((after.average(H) - 4.0).abs() < 1e-9, "{after:?}");
        // Carried in steps or at once: the same within rounding.
        let steps = (1..=10).fold(Decayed::default(), |d, i| d.carried(i * H / 10, 8, H));
        let once = Decayed::default().carried(H, 8, H);
        assert!((steps.gpu_ms - once.gpu_ms).abs() / once.gpu_ms < 1e-12);
        // Half a half-life of 8 GPUs: 8 * tau * (1 - 2^-0.5) GPU-ms.
        let half = Decayed::default().carried(H / 2, 8, H);
        let tau = H as f64 / LN_2;
        assert!((half.gpu_ms - 8.0 * tau * (1.0 - 0.5f64.sqrt())).abs() < 1e-3);
        // Time stepping back changes nothing.
        assert_eq!(half.carried(H / 4, 8, H), half);
    }
}
