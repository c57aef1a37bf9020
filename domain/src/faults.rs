//! What a GPU fault means and what is done about it: every health
//! condition a node reports (`XID-48`, `ECC-uncorrected`, `NVML-unavailable`,
//! `DIAG-failed`, ...) is classified here into a severity and an action, in
//! the buckets of NVIDIA's XID catalog (restart the application, reset the
//! GPU, reboot the node, contact support, ignore), and a pool's fault
//! policy says whether the action is taken automatically.
//!
//! The action decides the rest: a condition whose action is `none` or
//! `restart_workload` is recorded and shown but keeps nothing off the GPU
//! (the workload that hit it sees the error itself and restarts); one that
//! asks to reset the GPU or to service it takes the GPU out of service (it
//! is quarantined and its live reservations end); one that asks to drain the
//! node drains it. A condition this catalog does not know is treated as
//! asking for a GPU reset: quarantined until a diagnostic passes, never
//! ignored.

use serde::{Deserialize, Serialize};

/// How bad a fault is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Info,
    Warning,
    Critical,
}

/// What a fault asks for, from the least to the most.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Nothing: recorded only.
    None,
    /// The workload that hit it restarts; the GPU is fine.
    RestartWorkload,
    /// The GPU is reset and diagnosed before it takes work again.
    ResetGpu,
    /// The node is drained (and rebooted) before it takes work again.
    DrainNode,
    /// The GPU needs hands: out of service until an operator clears it.
    Service,
}

impl Severity {
    pub fn name(self) -> &'static str {
        match self {
            Severity::Info => "info",
            Severity::Warning => "warning",
            Severity::Critical => "critical",
        }
    }
}

impl Action {
    /// Whether a GPU quarantined for it comes back by itself once the
    /// condition is gone and a diagnostic passes (a reset's outcome); the
    /// others wait for an operator.
    pub fn restored_by_diagnostic(self) -> bool {
        self == Action::ResetGpu
    }

    pub fn name(self) -> &'static str {
        match self {
            Action::None => "none",
            Action::RestartWorkload => "restart_workload",
            Action::ResetGpu => "reset_gpu",
            Action::DrainNode => "drain_node",
            Action::Service => "service",
        }
    }

    /// Whether the fault takes the GPU (or node) out of service.
    pub fn takes_out_of_service(self) -> bool {
        self >= Action::ResetGpu
    }
}

/// A condition, classified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Class {
    pub severity: Severity,
    pub action: Action,
    /// What it is, in a phrase.
    pub meaning: &'static str,
}

const fn class(severity: Severity, action: Action, meaning: &'static str) -> Class {
    Class {
        severity,
        action,
        meaning,
    }
}

/// The XIDs this catalog knows (after NVIDIA's XID catalog's resolution
/// buckets).
fn xid(n: u32) -> Option<Class> {
    use Action::*;
    use Severity::*;
    Some(match n {
        13 => class(
            Warning,
            RestartWorkload,
            "graphics engine exception (an application's fault)",
        ),
        31 => class(
            Warning,
            RestartWorkload,
            "GPU memory page fault (an application's fault)",
        ),
        43 => class(
            Warning,
            RestartWorkload,
            "GPU stopped processing (an application's fault)",
        ),
        45 => class(Info, None, "preemptive cleanup after an application ended"),
        48 => class(Critical, ResetGpu, "double-bit ECC error"),
        61 => class(Critical, ResetGpu, "internal micro-controller breakpoint"),
        62 => class(Critical, ResetGpu, "internal micro-controller halt"),
        63 => class(
            Info,
            None,
            "page retirement or row remapping recorded (applied at the next reset)",
        ),
        64 => class(Critical, Service, "page retirement or row remapping failed"),
        68 => class(Warning, RestartWorkload, "video decoder exception"),
        69 => class(Warning, RestartWorkload, "graphics engine class error"),
        74 => class(Critical, ResetGpu, "NVLink error"),
        79 => class(Critical, DrainNode, "GPU has fallen off the bus"),
        92 => class(Warning, None, "high single-bit ECC error rate"),
        94 => class(
            Warning,
            RestartWorkload,
            "contained ECC error (the application that hit it must restart)",
        ),
        95 => class(Critical, ResetGpu, "uncontained ECC error"),
        109 => class(Warning, RestartWorkload, "context switch timeout"),
        119 => class(Critical, ResetGpu, "GSP RPC timeout"),
        120 => class(Critical, ResetGpu, "GSP error"),
        140 => class(Critical, ResetGpu, "unrecovered ECC error"),
        154 => class(
            Critical,
            DrainNode,
            "the driver asks for a GPU reset or a node reboot",
        ),
        _ => return Option::None,
    })
}

/// Classifies a condition by its name.
pub fn classify(condition: &str) -> Class {
    use Action::*;
    use Severity::*;
    if let Some(n) = condition.strip_prefix("XID-").and_then(|n| n.parse().ok()) {
        return xid(n).unwrap_or(class(
            Warning,
            ResetGpu,
            "an XID this catalog does not know: reset and diagnosed to be safe",
        ));
    }
    match condition {
        "ECC-uncorrected" => class(Critical, ResetGpu, "uncorrected ECC errors counted by NVML"),
        "NVML-unavailable" => class(Critical, DrainNode, "the driver does not answer"),
        "DIAG-failed" => class(Critical, Service, "a diagnostic failed"),
        _ => class(
            Warning,
            ResetGpu,
            "a condition this catalog does not know: reset and diagnosed to be safe",
        ),
    }
}

/// A pool's fault policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// Whether faults are acted on automatically (`false`: advisory, they
    /// are reported and an operator acts).
    pub automatic: bool,
    /// The most of the pool's GPUs quarantined automatically, in percent
    /// (rounded down, but one GPU at least unless it is 0); past it faults
    /// are reported (`device.quarantine_withheld`) and an alert fires
    /// instead.
    pub max_quarantined_percent: u32,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy {
            automatic: true,
            max_quarantined_percent: DEFAULT_MAX_QUARANTINED_PERCENT,
        }
    }
}

/// The circuit breaker's default: a tenth of a pool.
pub const DEFAULT_MAX_QUARANTINED_PERCENT: u32 = 10;

impl Policy {
    /// Whether one more GPU may be quarantined automatically with
    /// `quarantined` of `total` out already.
    pub fn allows(&self, quarantined: usize, total: usize) -> bool {
        self.automatic && quarantined < self.limit(total)
    }

    /// `automatic` or `advisory`, as operators name it.
    pub fn mode(&self) -> &'static str {
        if self.automatic {
            "automatic"
        } else {
            "advisory"
        }
    }

    /// How many of `total` GPUs may be quarantined automatically.
    pub fn limit(&self, total: usize) -> usize {
        let pct = self.max_quarantined_percent.min(100) as usize;
        match pct {
            0 => 0,
            _ => (total * pct / 100).max(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn harmless_faults_are_told_from_fatal_ones() {
        assert_eq!(classify("XID-48").action, Action::ResetGpu);
        assert_eq!(classify("XID-48").severity, Severity::Critical);
        assert_eq!(classify("XID-13").action, Action::RestartWorkload);
        assert!(!classify("XID-13").action.takes_out_of_service());
        assert!(!classify("XID-45").action.takes_out_of_service());
        assert_eq!(classify("XID-79").action, Action::DrainNode);
        assert_eq!(classify("XID-64").action, Action::Service);
        assert_eq!(classify("NVML-unavailable").action, Action::DrainNode);
        // Unknown: out of service until diagnosed, never ignored.
        for unknown in ["XID-9999", "XID-x", "something-new"] {
            assert!(classify(unknown).action.takes_out_of_service(), "{unknown}");
        }
        assert_eq!(Action::ResetGpu.name(), "reset_gpu");
        assert_eq!(
            serde_json::to_value(Action::RestartWorkload).unwrap(),
            "restart_workload"
        );
    }

    #[test]
    fn the_breaker_holds_quarantine_to_its_share_of_the_pool() {
        let p = Policy::default();
        // 10% of 80 GPUs: 8 may be out.
        assert!(p.allows(7, 80));
        assert!(!p.allows(8, 80));
        assert!(p.allows(0, 5) && !p.allows(1, 5), "one GPU at least");
        let none = Policy {
            automatic: true,
            max_quarantined_percent: 0,
        };
        assert!(!none.allows(0, 80));
        let advisory = Policy {
            automatic: false,
            ..p
        };
        assert!(!advisory.allows(0, 80));
        let all = Policy {
            automatic: true,
            max_quarantined_percent: 100,
        };
        assert!(all.allows(79, 80) && !all.allows(80, 80));
    }
}
