//! MIG layouts: the profiles a GPU is split into, as operators write them
//! (`1g.10gb*7`, `3g.40gb,2g.20gb*2`), checked against what one GPU holds.
//! Pure; the backends apply a layout (NVML through the driver, the fake
//! device set in memory).

use std::fmt;

/// Compute slices of one MIG-capable GPU (A100, H100, H200, B200).
pub const SLICES: u32 = 7;

/// One MIG profile: `<slices>g.<memory>gb`, with an optional suffix NVIDIA
/// gives some (`+me`: with the media engines).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Profile {
    pub slices: u32,
    pub memory_gb: u32,
    pub suffix: String,
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}g.{}gb{}", self.slices, self.memory_gb, self.suffix)
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("invalid MIG profile {0:?}: use <slices>g.<memory>gb, e.g. 1g.10gb or 3g.40gb, optionally *COUNT")]
    Profile(String),
    #[error("the layout {layout} needs {slices} compute slices; a GPU has {SLICES}")]
    Slices { layout: String, slices: u32 },
    #[error("the layout {layout} needs {need} GB; the GPU has {has} GB")]
    Memory { layout: String, need: u32, has: u32 },
}

impl Profile {
    pub fn parse(s: &str) -> Result<Profile, LayoutError> {
        let bad = || LayoutError::Profile(s.to_string());
        let (slices, rest) = s.split_once("g.").ok_or_else(bad)?;
        let gb_at = rest.find("gb").ok_or_else(bad)?;
        let (memory, suffix) = (&rest[..gb_at], &rest[gb_at + 2..]);
        let slices: u32 = slices.parse().map_err(|_| bad())?;
        let memory_gb: u32 = memory.parse().map_err(|_| bad())?;
        let suffix_ok = suffix.is_empty()
            || (suffix.starts_with('+')
                && suffix.len() <= 8
                && suffix[1..].chars().all(|c| c.is_ascii_alphanumeric()));
        if !(1..=SLICES).contains(&slices) || memory_gb == 0 || !suffix_ok {
            return Err(bad());
        }
        Ok(Profile {
            slices,
            memory_gb,
            suffix: suffix.to_string(),
        })
    }
}

/// The class of a MIG instance of profile `profile` on a GPU of class
/// `gpu_class`: `H100-80GB/1g.10gb`, the form the region's class names take
/// for instances (`domain::mig_class`).
pub fn instance_class(gpu_class: &str, profile: &str) -> String {
    format!("{gpu_class}/{profile}")
}

/// A GPU's MIG instances, in order: empty for a whole GPU (MIG off).
pub type Layout = Vec<Profile>;

/// Parses `PROFILE[*COUNT],...` (empty, or `none`: MIG off).
pub fn parse_layout(s: &str) -> Result<Layout, LayoutError> {
    let s = s.trim();
    if s.is_empty() || s == "none" {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for part in s.split(',') {
        let (name, count) = match part.split_once('*') {
            Some((n, c)) => (
                n,
                c.parse::<u32>()
                    .ok()
                    .filter(|c| (1..=SLICES).contains(c))
                    .ok_or_else(|| LayoutError::Profile(part.to_string()))?,
            ),
            None => (part, 1),
        };
        let p = Profile::parse(name.trim())?;
        out.extend(std::iter::repeat_n(p, count as usize));
    }
    Ok(out)
}

/// The layout as operators write it: `1g.10gb*7`, `3g.40gb,2g.20gb*2`.
pub fn layout_text(layout: &[Profile]) -> String {
    if layout.is_empty() {
        return "none".into();
    }
    let mut parts: Vec<(String, u32)> = Vec::new();
    for p in layout {
        let name = p.to_string();
        match parts.last_mut() {
            Some((last, n)) if *last == name => *n += 1,
            _ => parts.push((name, 1)),
        }
    }
    parts
        .into_iter()
        .map(|(p, n)| if n == 1 { p } else { format!("{p}*{n}") })
        .collect::<Vec<_>>()
        .join(",")
}

/// Checks that `layout` fits one GPU of `memory_mb`: at most [`SLICES`]
/// compute slices, and no more memory than the GPU has.
pub fn check_fits(layout: &[Profile], memory_mb: u64) -> Result<(), LayoutError> {
    let slices: u32 = layout.iter().map(|p| p.slices).sum();
    if slices > SLICES {
        return Err(LayoutError::Slices {
            layout: layout_text(layout),
            slices,
        });
    }
    let need: u32 = layout.iter().map(|p| p.memory_gb).sum();
    // The GPU's memory in GB, rounded as its class name is (80 GB: 81,559 MB).
    let has = ((memory_mb + 512) / 1024) as u32;
    if need > has {
        return Err(LayoutError::Memory {
            layout: layout_text(layout),
            need,
            has,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_parse_print_and_must_fit_one_gpu() {
        let l = parse_layout("1g.10gb*7").unwrap();
        assert_eq!(l.len(), 7);
        assert_eq!(layout_text(&l), "1g.10gb*7");
        check_fits(&l, 81_559).unwrap();
        let l = parse_layout("3g.40gb, 2g.20gb*2").unwrap();
        assert_eq!(layout_text(&l), "3g.40gb,2g.20gb*2");
        check_fits(&l, 80 * 1024).unwrap();
        assert_eq!(parse_layout("1g.10gb+me").unwrap()[0].suffix, "+me");
        assert!(parse_layout("none").unwrap().is_empty());
        assert!(parse_layout("").unwrap().is_empty());
        for bad in [
            "1g",
            "g.10gb",
            "8g.80gb",
            "1g.0gb",
            "1g.10gb*0",
            "1g.10gb*x",
            "1g.10gb+m e",
            "x",
        ] {
            assert!(parse_layout(bad).is_err(), "{bad}");
        }
        assert!(matches!(
            check_fits(&parse_layout("4g.40gb*2").unwrap(), 80 * 1024),
            Err(LayoutError::Slices { slices: 8, .. })
        ));
        let err = check_fits(&parse_layout("1g.20gb*5").unwrap(), 80 * 1024).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the layout 1g.20gb*5 needs 100 GB; the GPU has 80 GB"
        );
    }
}
