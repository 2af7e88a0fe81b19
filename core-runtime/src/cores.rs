//! Which CPUs the broker runs on, and the dense core index everything else uses.

use std::fmt;
use std::str::FromStr;

/// A core's index among the runtime's cores (`0..cores`), not its CPU number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct CoreId(pub usize);

impl CoreId {
    /// The index.
    pub const fn index(self) -> usize {
        self.0
    }
}

impl fmt::Display for CoreId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The CPUs to pin one executor each to, in core-index order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoreSet {
    cpus: Vec<usize>,
}

/// Why a core list does not parse or fit the machine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreSetError {
    /// Not `N`, `N-M` or a comma list of those.
    #[error("invalid core list {0:?}: expected e.g. `0-3`, `0,2` or `all`")]
    Syntax(String),
    /// A CPU listed twice.
    #[error("CPU {0} is listed twice")]
    Duplicate(usize),
    /// A CPU this process may not run on.
    #[error("CPU {cpu} is not available to this process (available: {available:?})")]
    Unavailable {
        /// The CPU.
        cpu: usize,
        /// What is.
        available: Vec<usize>,
    },
}

/// CPUs this process may run on (its affinity mask).
pub fn available_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

impl CoreSet {
    /// Every CPU this process may use.
    pub fn all() -> CoreSet {
        CoreSet {
            cpus: available_cpus(),
        }
    }

    /// Exactly these CPUs, checked against the affinity mask.
    pub fn new(cpus: Vec<usize>) -> Result<CoreSet, CoreSetError> {
        let available = available_cpus();
        let mut seen = std::collections::HashSet::new();
        for &c in &cpus {
            if !seen.insert(c) {
                return Err(CoreSetError::Duplicate(c));
            }
            if !available.contains(&c) {
                return Err(CoreSetError::Unavailable {
                    cpu: c,
                    available: available.clone(),
                });
            }
        }
        if cpus.is_empty() {
            return Err(CoreSetError::Syntax(String::new()));
        }
        Ok(CoreSet { cpus })
    }

    /// Number of cores.
    pub fn len(&self) -> usize {
        self.cpus.len()
    }

    /// True when empty (never, for a constructed set).
    pub fn is_empty(&self) -> bool {
        self.cpus.is_empty()
    }

    /// The CPU of a core.
    pub fn cpu(&self, core: CoreId) -> usize {
        self.cpus[core.0]
    }

    /// The CPUs, in core order.
    pub fn cpus(&self) -> &[usize] {
        &self.cpus
    }
}

impl FromStr for CoreSet {
    type Err = CoreSetError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s == "all" {
            return Ok(CoreSet::all());
        }
        let syntax = || CoreSetError::Syntax(s.to_owned());
        let mut cpus = Vec::new();
        for part in s.split(',') {
            let part = part.trim();
            match part.split_once('-') {
                Some((a, b)) => {
                    let a: usize = a.trim().parse().map_err(|_| syntax())?;
                    let b: usize = b.trim().parse().map_err(|_| syntax())?;
                    if a > b || b - a > 4096 {
                        return Err(syntax());
                    }
                    cpus.extend(a..=b);
                }
                None => cpus.push(part.parse().map_err(|_| syntax())?),
            }
        }
        CoreSet::new(cpus)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_and_ranges_parse_against_the_affinity_mask() {
        let first = available_cpus()[0];
        assert_eq!(
            format!("{first}").parse::<CoreSet>().unwrap().cpus(),
            &[first]
        );
        assert_eq!(
            format!("{first}-{first}").parse::<CoreSet>().unwrap().len(),
            1
        );
        assert!(matches!(
            "0,0".parse::<CoreSet>(),
            Err(CoreSetError::Duplicate(0))
        ));
        assert!(matches!(
            "x".parse::<CoreSet>(),
            Err(CoreSetError::Syntax(_))
        ));
        assert!(matches!(
            "3-1".parse::<CoreSet>(),
            Err(CoreSetError::Syntax(_))
        ));
        assert!(matches!(
            "100000".parse::<CoreSet>(),
            Err(CoreSetError::Unavailable { .. })
        ));
        assert!(!"all".parse::<CoreSet>().unwrap().is_empty());
    }
}
