//! Network faults between the region's processes: a role that a fault may
//! cut off runs in a network namespace of its own, joined to this host's
//! namespace by a veth pair (`10.77.<n>.1` on the host's side, `10.77.<n>.2`
//! on the role's). PostgreSQL and the simulated nodes stay on the host's
//! side, so a rule in the role's namespace cuts exactly one link:
//! `iptables` drops (silence, not refusal: what a cable pulled or a switch
//! gone does), `tc netem` delays and loses packets (where the kernel has
//! netem; else only the loss, with `iptables -m statistic`).
//!
//! Needs root (`ip netns`, `iptables`, `tc`); the namespaces are removed
//! when dropped.

use anyhow::{bail, Context, Result};
use std::process::Command;

/// One role's network namespace and its link to the host.
pub struct Netns {
    pub name: String,
    /// The host's side of the link (where the role reaches PostgreSQL).
    pub host_ip: String,
    /// The role's side (where the nodes reach a gateway).
    pub role_ip: String,
    host_dev: String,
    role_dev: String,
}

fn run(args: &[&str]) -> Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("run {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Netns {
    /// Creates namespace `strata-drill-<n>` with its link (n in 1..=250).
    pub fn create(n: u8) -> Result<Netns> {
        let ns = Netns {
            name: format!("strata-drill-{n}"),
            host_ip: format!("10.77.{n}.1"),
            role_ip: format!("10.77.{n}.2"),
            host_dev: format!("sdr{n}h"),
            role_dev: format!("sdr{n}r"),
        };
        // What an earlier drill that died left behind.
        let _ = run(&["ip", "netns", "del", &ns.name]);
        let _ = run(&["ip", "link", "del", &ns.host_dev]);
        run(&["ip", "netns", "add", &ns.name])?;
        run(&[
            "ip",
            "link",
            "add",
            &ns.host_dev,
            "type",
            "veth",
            "peer",
            "name",
            &ns.role_dev,
        ])?;
        run(&["ip", "link", "set", &ns.role_dev, "netns", &ns.name])?;
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{}/24", ns.host_ip),
            "dev",
            &ns.host_dev,
        ])?;
        run(&["ip", "link", "set", &ns.host_dev, "up"])?;
        ns.exec(&[
            "ip",
            "addr",
            "add",
            &format!("{}/24", ns.role_ip),
            "dev",
            &ns.role_dev,
        ])?;
        ns.exec(&["ip", "link", "set", &ns.role_dev, "up"])?;
        ns.exec(&["ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    fn exec(&self, args: &[&str]) -> Result<()> {
        let mut a = vec!["ip", "netns", "exec", &self.name];
        a.extend_from_slice(args);
        run(&a)
    }

    /// The command line prefix that runs a program in this namespace.
    pub fn prefix(&self) -> Vec<String> {
        ["ip", "netns", "exec", &self.name]
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    /// Silences the role's link to `port` on the host (its connections to
    /// PostgreSQL, say): packets both ways are dropped.
    pub fn cut_to_host_port(&self, port: u16) -> Result<()> {
        let p = port.to_string();
        self.exec(&[
            "iptables",
            "-A",
            "OUTPUT",
            "-d",
            &self.host_ip,
            "-p",
            "tcp",
            "--dport",
            &p,
            "-j",
            "DROP",
        ])?;
        self.exec(&[
            "iptables",
            "-A",
            "INPUT",
            "-s",
            &self.host_ip,
            "-p",
            "tcp",
            "--sport",
            &p,
            "-j",
            "DROP",
        ])
    }

    /// Silences whoever reaches the role on its `port` (the nodes of a
    /// gateway): packets both ways are dropped.
    pub fn cut_role_port(&self, port: u16) -> Result<()> {
        let p = port.to_string();
        self.exec(&[
            "iptables", "-A", "INPUT", "-p", "tcp", "--dport", &p, "-j", "DROP",
        ])?;
        self.exec(&[
            "iptables", "-A", "OUTPUT", "-p", "tcp", "--sport", &p, "-j", "DROP",
        ])
    }

    /// Delays every packet on the link by `delay_ms` each way and loses
    /// `loss_pct` of them (`tc netem`). A kernel without netem loses them
    /// all the same (`iptables -m statistic`, both ways) but cannot delay
    /// them: the delay applied is returned, 0 then.
    pub fn degrade(&self, delay_ms: u32, loss_pct: f64) -> Result<u32> {
        let (d, l) = (format!("{delay_ms}ms"), format!("{loss_pct}%"));
        let netem = ["root", "netem", "delay", &d, "loss", &l];
        let mut host = vec!["tc", "qdisc", "add", "dev", &self.host_dev];
        host.extend_from_slice(&netem);
        if run(&host).is_ok() {
            let mut role = vec!["tc", "qdisc", "add", "dev", &self.role_dev];
            role.extend_from_slice(&netem);
            self.exec(&role)?;
            return Ok(delay_ms);
        }
        let p = format!("{}", loss_pct / 100.0);
        for chain in ["INPUT", "OUTPUT"] {
            self.exec(&[
                "iptables",
                "-A",
                chain,
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                &p,
                "-j",
                "DROP",
            ])?;
        }
        Ok(0)
    }

    /// Every fault of this namespace taken away.
    pub fn heal(&self) -> Result<()> {
        self.exec(&["iptables", "-F"])?;
        let _ = run(&["tc", "qdisc", "del", "dev", &self.host_dev, "root"]);
        let _ = self.exec(&["tc", "qdisc", "del", "dev", &self.role_dev, "root"]);
        Ok(())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run(&["ip", "netns", "del", &self.name]);
        let _ = run(&["ip", "link", "del", &self.host_dev]);
    }
}

/// Whether this process may make namespaces (root, with the tools).
pub fn available() -> bool {
    match Netns::create(250) {
        Ok(ns) => {
            drop(ns);
            true
        }
        Err(e) => {
            eprintln!("network faults unavailable: {e:#}");
            false
        }
    }
}
