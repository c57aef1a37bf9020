//! `gauge`: instruction counts of Strata's CPU-bound paths, which do not
//! drift with the machine the way times do. Each workload (the planner on
//! a fixed pool and demand, the index fold of its log, the pgoutput decoder
//! on that log as WAL) runs under `valgrind --tool=callgrind`, counting only
//! the measured function (`--toggle-collect`), and is checked against the
//! committed baseline: more than `--tolerance` percent over it fails.
//!
//! ```text
//! gauge            check every workload against gauge/baseline.json
//! gauge update     measure and write the baseline
//! gauge run plan   run one workload (what callgrind runs)
//! ```

mod decode;
mod fold;
mod plan;
mod world;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The workloads, by name.
const WORKLOADS: [&str; 3] = ["plan", "fold", "decode"];

#[derive(Parser, Debug)]
#[command(
    name = "gauge",
    about = "Instruction counts of the planner, the index fold and the pgoutput decoder under callgrind, checked against a committed baseline"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
    /// The committed baseline
    #[arg(long, global = true, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/baseline.json"))]
    baseline: PathBuf,
    /// Where the measured counts are written (JSON)
    #[arg(long, global = true, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/results/instructions.json"))]
    out: PathBuf,
    /// Percent over the baseline that fails the check
    #[arg(long, global = true, default_value_t = 10.0)]
    tolerance: f64,
    /// The valgrind to run
    #[arg(long, global = true, default_value = "valgrind")]
    valgrind: PathBuf,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Check every workload against the baseline (the default)
    Check,
    /// Measure every workload and write the baseline
    Update,
    /// Run one workload, uncounted unless under callgrind: plan, fold or decode
    Run { workload: String },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command.as_ref().unwrap_or(&Cmd::Check) {
        Cmd::Run { workload } => {
            let result = match workload.as_str() {
                "plan" => plan::run() as u64,
                "fold" => fold::run(),
                "decode" => decode::run() as u64,
                other => bail!("no workload {other:?}; the workloads are {WORKLOADS:?}"),
            };
            println!("{workload}: {result}");
            Ok(())
        }
        Cmd::Update => {
            let counts = measure_all(&cli.valgrind)?;
            let baseline = json!({
                "note": "instructions counted by callgrind in each workload's measured function; written by `gauge update`",
                "machine": machine(),
                "instructions": counts.iter().map(|(w, n)| (w.to_string(), json!(n))).collect::<serde_json::Map<_, _>>(),
            });
            write_json(&cli.baseline, &baseline)?;
            eprintln!("wrote {}", cli.baseline.display());
            Ok(())
        }
        Cmd::Check => check(&cli),
    }
}

fn check(cli: &Cli) -> Result<()> {
    let baseline: Value = serde_json::from_str(
        &std::fs::read_to_string(&cli.baseline)
            .with_context(|| format!("read the baseline {}", cli.baseline.display()))?,
    )
    .with_context(|| format!("parse the baseline {}", cli.baseline.display()))?;
    let here = machine();
    if baseline["machine"]["rustc"] != here["rustc"] {
        eprintln!(
            "note: the baseline was counted with {}, this build with {}: counts change with the compiler",
            baseline["machine"]["rustc"], here["rustc"]
        );
    }
    let counts = measure_all(&cli.valgrind)?;
    let (rows, failed) = judge(&counts, &baseline, cli.tolerance)?;
    write_json(
        &cli.out,
        &json!({
            "bench": "instructions",
            "machine": here,
            "tolerance_percent": cli.tolerance,
            "workloads": rows,
            "baseline_machine": baseline["machine"],
        }),
    )?;
    if !failed.is_empty() {
        bail!(
            "instruction counts over the baseline by more than {}%: {}",
            cli.tolerance,
            failed.join(", ")
        );
    }
    Ok(())
}

/// Each count against its baseline: a row per workload, and the
/// workloads more than `tolerance` percent over it.
fn judge(
    counts: &[(&str, u64)],
    baseline: &Value,
    tolerance: f64,
) -> Result<(serde_json::Map<String, Value>, Vec<String>)> {
    let mut failed = Vec::new();
    let mut rows = serde_json::Map::new();
    for (workload, n) in counts {
        let base = baseline["instructions"][workload]
            .as_u64()
            .filter(|b| *b > 0)
            .with_context(|| format!("the baseline has no count for {workload}"))?;
        let ratio = *n as f64 / base as f64;
        let ok = ratio <= 1.0 + tolerance / 100.0;
        eprintln!(
            "{workload:>7}: {n:>14} instructions, baseline {base:>14}: {ratio:.3}x {}",
            if ok { "ok" } else { "REGRESSED" }
        );
        if !ok {
            failed.push(format!("{workload} {ratio:.3}x"));
        }
        rows.insert(
            workload.to_string(),
            json!({"instructions": n, "baseline": base, "ratio": (ratio * 1000.0).round() / 1000.0, "ok": ok}),
        );
    }
    Ok((rows, failed))
}

/// Every workload's count, in order.
fn measure_all(valgrind: &Path) -> Result<Vec<(&'static str, u64)>> {
    let dir = std::env::temp_dir().join(format!("gauge-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let out = WORKLOADS
        .iter()
        .map(|w| Ok((*w, measure(valgrind, &dir, w)?)))
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    out
}

/// Runs one workload under callgrind, collecting in its measured function
/// only, and reads the instructions counted.
fn measure(valgrind: &Path, dir: &Path, workload: &str) -> Result<u64> {
    let file = dir.join(format!("{workload}.callgrind"));
    let exe = std::env::current_exe().context("find this program")?;
    let t = std::time::Instant::now();
    let status = Command::new(valgrind)
        .arg("--tool=callgrind")
        .arg(format!("--toggle-collect=*gauge_measured_{workload}"))
        .arg(format!("--callgrind-out-file={}", file.display()))
        .arg("--quiet")
        .arg(&exe)
        .args(["run", workload])
        .stdout(std::process::Stdio::null())
        .status()
        .with_context(|| format!("run {} (is valgrind installed?)", valgrind.display()))?;
    if !status.success() {
        bail!("callgrind on {workload} ended with {status}");
    }
    let text =
        std::fs::read_to_string(&file).with_context(|| format!("read {}", file.display()))?;
    let n = totals(&text).with_context(|| format!("no totals in {}", file.display()))?;
    if n == 0 {
        bail!("callgrind counted nothing in gauge_measured_{workload}: the function was not found");
    }
    eprintln!(
        "  {workload}: counted in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Ok(n)
}

/// The instructions of a callgrind output file (`totals:`, else `summary:`).
fn totals(text: &str) -> Option<u64> {
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
    };
    field("totals:").or_else(|| field("summary:"))
}

fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let rustc = Command::new("rustc")
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    json!({
        "cpu_model": cpu,
        "rustc": rustc,
        "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "note": "instruction counts do not depend on the machine's speed or load; they change with the compiler, the allocator and the code",
    })
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, serde_json::to_string_pretty(v)? + "\n")
        .with_context(|| format!("write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_are_read_from_a_callgrind_file() {
        let file = "version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nsummary: 1234\n\nfn=(1) x\n1 2\ntotals: 1200\n";
        assert_eq!(totals(file), Some(1200));
        assert_eq!(totals("events: Ir\nsummary: 99\n"), Some(99));
        assert_eq!(totals("events: Ir\n"), None);
    }

    #[test]
    fn a_count_more_than_the_tolerance_over_its_baseline_fails() {
        let baseline = json!({"instructions": {"plan": 1000, "fold": 1000}});
        let (rows, failed) = judge(&[("plan", 1100), ("fold", 1101)], &baseline, 10.0).unwrap();
        assert_eq!(failed, ["fold 1.101x"]);
        assert_eq!(rows["plan"]["ok"], true);
        assert_eq!(rows["fold"]["ok"], false);
        // Fewer instructions always pass; a workload missing from the
        // baseline is an error, not a pass.
        assert!(judge(&[("plan", 10)], &baseline, 10.0)
            .unwrap()
            .1
            .is_empty());
        assert!(judge(&[("decode", 10)], &baseline, 10.0).is_err());
    }
}
