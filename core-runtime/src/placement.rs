//! Which core owns which shard.
//!
//! By default a shard lands on `(hash(tenant, namespace, name) + shard) % cores`, so a
//! stream's shards spread over the cores in order. Operators override it with a pinning
//! table of rules (`tenant/namespace/name/shard=core`, `*` matching anything; first match
//! wins). The table is an immutable snapshot swapped in whole: resolving an owner is one
//! atomic load, and a new table (moving a shard to another core online) never mutates one
//! a reader holds. A core receiving a request re-checks ownership against the snapshot
//! it sees, so a request routed by an older table is redirected rather than served by
//! the wrong core.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::cores::CoreId;

/// Streams and caches are placed independently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ShardKind {
    /// A stream shard.
    Stream,
    /// A cache shard.
    Cache,
}

/// One shard of one stream or cache.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShardKey {
    /// Stream or cache.
    pub kind: ShardKind,
    /// Tenant.
    pub tenant: String,
    /// Namespace.
    pub namespace: String,
    /// Stream or cache name.
    pub name: String,
    /// Shard index.
    pub shard: u32,
}

impl fmt::Display for ShardKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            ShardKind::Stream => "stream",
            ShardKind::Cache => "cache",
        };
        write!(
            f,
            "{kind}:{}/{}/{}/{}",
            self.tenant, self.namespace, self.name, self.shard
        )
    }
}

/// One operator pinning rule; `None` fields match anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinRule {
    /// Tenant, or any.
    pub tenant: Option<String>,
    /// Namespace, or any.
    pub namespace: Option<String>,
    /// Stream/cache name, or any.
    pub name: Option<String>,
    /// Shard, or any.
    pub shard: Option<u32>,
    /// The core to run matching shards on.
    pub core: CoreId,
}

impl PinRule {
    /// Whether this rule decides `key`'s core (when no rule before it does).
    pub fn matches(&self, key: &ShardKey) -> bool {
        self.tenant.as_ref().is_none_or(|t| *t == key.tenant)
            && self.namespace.as_ref().is_none_or(|n| *n == key.namespace)
            && self.name.as_ref().is_none_or(|n| *n == key.name)
            && self.shard.is_none_or(|s| s == key.shard)
    }
}

/// A malformed pinning rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid pin rule {rule:?}: {reason} (expected tenant/namespace/name/shard=core, * for any)"
)]
pub struct PinRuleError {
    /// The rule as written.
    pub rule: String,
    /// What is wrong.
    pub reason: &'static str,
}

impl PinRule {
    /// Whether two rules match the same shards (they may name different cores).
    pub fn same_pattern(&self, other: &PinRule) -> bool {
        self.tenant == other.tenant
            && self.namespace == other.namespace
            && self.name == other.name
            && self.shard == other.shard
    }
}

impl fmt::Display for PinRule {
    /// As it is parsed: `tenant/namespace/name/shard=core`, `*` for any.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let part = |p: &Option<String>| p.clone().unwrap_or_else(|| "*".to_owned());
        let shard = self.shard.map_or_else(|| "*".to_owned(), |s| s.to_string());
        write!(
            f,
            "{}/{}/{}/{shard}={}",
            part(&self.tenant),
            part(&self.namespace),
            part(&self.name),
            self.core.0
        )
    }
}

/// The longest tenant, namespace, stream or cache name.
const NAME_MAX_BYTES: usize = 128;

impl FromStr for PinRule {
    type Err = PinRuleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| PinRuleError {
            rule: s.to_owned(),
            reason,
        };
        let (pattern, core) = s.split_once('=').ok_or_else(|| err("missing `=core`"))?;
        let core = core
            .trim()
            .parse()
            .map_err(|_| err("core is not a number"))?;
        let mut parts: Vec<&str> = pattern.trim().split('/').collect();
        if parts.len() == 3 {
            // `tenant/namespace/name=core`: every shard.
            parts.push("*");
        }
        if parts.len() != 4 {
            return Err(err("pattern needs three or four parts"));
        }
        // A name is at most 128 bytes: a longer part matches nothing, and a rule held
        // (and written to `pins.json`, and cloned at each re-pin) may be megabytes.
        if parts[..3].iter().any(|p| p.len() > NAME_MAX_BYTES) {
            return Err(err("a name is at most 128 bytes"));
        }
        let any = |p: &str| (p != "*").then(|| p.to_owned());
        Ok(PinRule {
            tenant: any(parts[0]),
            namespace: any(parts[1]),
            name: any(parts[2]),
            shard: match parts[3] {
                "*" => None,
                n => Some(n.parse().map_err(|_| err("shard is not a number or *"))?),
            },
            core: CoreId(core),
        })
    }
}

/// An immutable placement: the number of cores and the pinning rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementTable {
    cores: usize,
    rules: Vec<PinRule>,
    version: u64,
}

/// A rule that names a core the runtime does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pin rule names core {core} but the broker runs {cores} cores")]
pub struct NoSuchCore {
    /// The core named.
    pub core: CoreId,
    /// Cores available.
    pub cores: usize,
}

fn fnv(parts: &[&str]) -> u64 {
    use felix_wire::routing::{finalize, fnv1a64, fnv1a64_update};
    let h = parts.iter().fold(fnv1a64(&[]), |h, p| {
        fnv1a64_update(
            fnv1a64_update(h, &(p.len() as u64).to_be_bytes()),
            p.as_bytes(),
        )
    });
    finalize(h)
}

impl PlacementTable {
    /// A table for `cores` cores with these rules.
    pub fn new(
        cores: usize,
        rules: Vec<PinRule>,
        version: u64,
    ) -> Result<PlacementTable, NoSuchCore> {
        assert!(cores > 0, "a runtime has at least one core");
        if let Some(r) = rules.iter().find(|r| r.core.0 >= cores) {
            return Err(NoSuchCore {
                core: r.core,
                cores,
            });
        }
        Ok(PlacementTable {
            cores,
            rules,
            version,
        })
    }

    /// The core that owns `key`.
    pub fn core_for(&self, key: &ShardKey) -> CoreId {
        if let Some(r) = self.rules.iter().find(|r| r.matches(key)) {
            return r.core;
        }
        let base = fnv(&[
            match key.kind {
                ShardKind::Stream => "s",
                ShardKind::Cache => "c",
            },
            &key.tenant,
            &key.namespace,
            &key.name,
        ]);
        CoreId(((base % self.cores as u64 + u64::from(key.shard)) % self.cores as u64) as usize)
    }

    /// This table with `rule` ahead of every other (it wins), replacing a rule for the
    /// same shards; the version is bumped.
    pub fn with_rule(&self, rule: PinRule) -> Result<PlacementTable, NoSuchCore> {
        let mut rules = vec![rule.clone()];
        rules.extend(
            self.rules
                .iter()
                .filter(|r| !r.same_pattern(&rule))
                .cloned(),
        );
        PlacementTable::new(self.cores, rules, self.version + 1)
    }

    /// Whether an operator rule decided `key` (for the admin view).
    pub fn pinned(&self, key: &ShardKey) -> bool {
        self.rules.iter().any(|r| r.matches(key))
    }

    /// Cores.
    pub fn cores(&self) -> usize {
        self.cores
    }

    /// The rules.
    pub fn rules(&self) -> &[PinRule] {
        &self.rules
    }

    /// Bumped on every change.
    pub fn version(&self) -> u64 {
        self.version
    }
}

/// The current placement, shared by every core; replaced whole.
#[derive(Debug)]
pub struct Placement {
    current: ArcSwap<PlacementTable>,
}

impl Placement {
    /// Starts with `table`.
    pub fn new(table: PlacementTable) -> Placement {
        Placement {
            current: ArcSwap::from_pointee(table),
        }
    }

    /// The current table (one atomic load).
    pub fn load(&self) -> Arc<PlacementTable> {
        self.current.load_full()
    }

    /// The owner of `key` under the current table.
    pub fn core_for(&self, key: &ShardKey) -> CoreId {
        self.current.load().core_for(key)
    }

    /// Swaps in a new table.
    pub fn replace(&self, table: PlacementTable) {
        self.current.store(Arc::new(table));
    }

    /// Swaps in a new table already shared.
    pub fn replace_arc(&self, table: Arc<PlacementTable>) {
        self.current.store(table);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str, shard: u32) -> ShardKey {
        ShardKey {
            kind: ShardKind::Stream,
            tenant: "t".into(),
            namespace: "default".into(),
            name: name.into(),
            shard,
        }
    }

    #[test]
    fn a_streams_shards_spread_over_every_core() {
        let table = PlacementTable::new(4, vec![], 0).unwrap();
        let cores: std::collections::HashSet<_> =
            (0..4).map(|s| table.core_for(&key("orders", s))).collect();
        assert_eq!(cores.len(), 4);
        assert_eq!(
            table.core_for(&key("orders", 1)),
            table.core_for(&key("orders", 1))
        );
    }

    /// A rule's names are at most 128 bytes, as a name is: an operator's rule of
    /// megabytes was held, written to `pins.json` and cloned at every re-pin.
    #[test]
    fn a_rule_naming_more_than_a_name_holds_is_refused() {
        let long = "n".repeat(129);
        assert!(format!("t/default/{long}=0").parse::<PinRule>().is_err());
        assert!(
            format!("{long}/default/orders/1=0")
                .parse::<PinRule>()
                .is_err()
        );
        let longest = "n".repeat(128);
        assert!(format!("t/default/{longest}=0").parse::<PinRule>().is_ok());
    }

    #[test]
    fn first_matching_pin_rule_wins_and_bad_rules_are_refused() {
        let rules = vec![
            "t/default/orders/2=3".parse::<PinRule>().unwrap(),
            "t/*/orders/*=1".parse::<PinRule>().unwrap(),
        ];
        let table = PlacementTable::new(4, rules, 1).unwrap();
        assert_eq!(table.core_for(&key("orders", 2)), CoreId(3));
        assert_eq!(table.core_for(&key("orders", 0)), CoreId(1));
        assert!(table.pinned(&key("orders", 7)));
        assert!(!table.pinned(&key("payments", 0)));
        assert_eq!(
            "t/a/b=1".parse::<PinRule>().unwrap().to_string(),
            "t/a/b/*=1"
        );
        assert!("t/a=1".parse::<PinRule>().is_err());
        assert!("t/a/b/x=1".parse::<PinRule>().is_err());
        assert!("t/a/b/1".parse::<PinRule>().is_err());
        assert_eq!(
            PlacementTable::new(2, vec!["*/*/*/*=5".parse().unwrap()], 0),
            Err(NoSuchCore {
                core: CoreId(5),
                cores: 2
            })
        );
    }

    #[test]
    fn a_new_rule_wins_and_replaces_one_for_the_same_shards() {
        let table = PlacementTable::new(4, vec!["t/*/orders/*=1".parse().unwrap()], 3).unwrap();
        let moved = table
            .with_rule("t/default/orders/2=3".parse().unwrap())
            .unwrap();
        assert_eq!(moved.version(), 4);
        assert_eq!(moved.core_for(&key("orders", 2)), CoreId(3));
        assert_eq!(moved.core_for(&key("orders", 0)), CoreId(1));
        let back = moved
            .with_rule("t/default/orders/2=0".parse().unwrap())
            .unwrap();
        assert_eq!(back.rules().len(), 2);
        assert_eq!(back.core_for(&key("orders", 2)), CoreId(0));
        assert!(table.with_rule("*/*/*/*=9".parse().unwrap()).is_err());
        for r in back.rules() {
            assert_eq!(r.to_string().parse::<PinRule>().unwrap(), *r);
        }
    }

    #[test]
    fn a_replaced_table_is_seen_by_new_loads_only() {
        let p = Placement::new(PlacementTable::new(2, vec![], 0).unwrap());
        let old = p.load();
        p.replace(PlacementTable::new(2, vec!["*/*/*/*=1".parse().unwrap()], 1).unwrap());
        assert_eq!(old.version(), 0);
        assert_eq!(p.load().version(), 1);
        assert_eq!(p.core_for(&key("x", 0)), CoreId(1));
    }
}
