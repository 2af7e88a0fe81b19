//! How much of what every broker reads whole one tenant, and the whole cluster, may hold.
//!
//! Each broker reads the assignment snapshot, the replication view, the streams
//! snapshot and the live token denials in one answer at every full sync, and refuses an
//! answer over [`crate::client::MAX_ANSWER_BYTES`]. Unbounded, one tenant with
//! `stream.manage` or `tenant.manage` on itself could grow them past that (some 35,000
//! shards, or 40,000 denials, when the bound was 16 MiB) and no broker could sync again:
//! every tenant's leases would lapse. Shards and denials are therefore counted at
//! create, per tenant and cluster-wide, and a create past a bound is answered 409.
//!
//! The cluster's totals are kept in one fence document, which every counted create and
//! every delete rewrites at the version it read before it counted: two writes at once
//! cannot both pass a count (the later one's batch fails, and it counts again), and no
//! write counts more than its own tenant's documents.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::store::{Expect, Kind, Op, Store, StoreError};

/// Shards (stream and cache shards together) one tenant may hold: two streams of the
/// largest shard count.
pub const TENANT_SHARDS_MAX: u64 = 8_192;
/// Shards the whole cluster may hold: at the worst case of every name, node id and
/// replica set at its longest, the assignment snapshot and the replication view stay
/// within what a broker reads (`the_bounds_keep_every_snapshot_a_broker_reads_whole`).
pub const CLUSTER_SHARDS_MAX: u64 = 16_384;
/// Denials in force one tenant may hold. A tenant that must revoke more tokens than
/// this retires the key that signed them instead.
pub const TENANT_DENIALS_MAX: usize = 1_024;
/// Denials the whole cluster may store (in force, or lapsed and not yet dropped).
pub const CLUSTER_DENIALS_MAX: u64 = 16_384;

/// The `Meta` key of the fence document.
const FENCE_KEY: &str = "limits-fence";

/// Why a create was refused: what is held, what the bound is, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverLimit(pub String);

/// The cluster's totals, kept in the fence document so that a create or a denial
/// counts only its own tenant's documents, never the whole cluster's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Totals {
    /// Shards of every stream and cache.
    pub shards: u64,
    /// Denial documents stored (lapsed ones until their tenant's next denial drops
    /// them).
    pub denials: u64,
}

/// The fence as read: the totals, and the version a write of new ones expects.
#[derive(Debug)]
pub struct Fence {
    /// This control plane's counted writes take turns while they hold a fence read
    /// by [`fence`] (`None` for the placement pass's own read).
    _turn: Option<tokio::sync::OwnedMutexGuard<()>>,
    /// The cluster's totals as of the read.
    pub totals: Totals,
    expect: Expect,
    /// Whether the totals were read from the document (not counted whole for want of
    /// one).
    kept: bool,
}

impl Fence {
    /// The write of `totals` at the version read, for the counted write's batch: a
    /// counted write that landed meanwhile moved the version, so the batch fails and
    /// the caller counts again.
    pub fn write(&self, totals: Totals) -> Op {
        Op::Put {
            kind: Kind::Meta,
            key: FENCE_KEY.to_owned(),
            value: serde_json::to_value(totals).expect("totals serialize"),
            expect: self.expect,
        }
    }
}

/// Counted writes of one control plane take turns from reading the fence to writing
/// it: all of them rewrite that one document, and writes at once would otherwise
/// collide, count again and collide again (of 32 creates at once, most were refused).
/// Only writes of other control planes sharing the store, and the placement pass's
/// mend, still race them (see `raced_again` in the API).
#[derive(Debug, Clone)]
pub struct Turns {
    turn: std::sync::Arc<tokio::sync::Mutex<()>>,
    /// How long a write waits for its turn: [`TURN_WAIT_MAX`].
    wait_max: std::time::Duration,
}

impl Default for Turns {
    fn default() -> Self {
        Turns {
            turn: Default::default(),
            wait_max: TURN_WAIT_MAX,
        }
    }
}

/// The longest a counted write waits for its turn before it fails `Unavailable`: the
/// Postgres store's own bound on an operation. With the store stalled, each write in
/// turn takes up to that bound on its operations, and those queued behind would
/// otherwise wait for all of them.
const TURN_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(20);

/// Reads the fence, read *before* anything a counted write counts, in this control
/// plane's turn of counted writes (`turns`), held until the [`Fence`] is dropped (after
/// its batch). A store without one (or with one it cannot read) is counted whole, once,
/// by the write that adds it.
pub async fn fence(store: &dyn Store, turns: &Turns) -> Result<Fence, StoreError> {
    let turn = tokio::time::timeout(turns.wait_max, turns.turn.clone().lock_owned())
        .await
        .map_err(|_| {
            StoreError::Unavailable(format!(
                "a counted write waited {:?} for its turn (the store is slow or stalled): \
                 try again",
                turns.wait_max
            ))
        })?;
    let mut fence = fence_outside_turns(store).await?;
    fence._turn = Some(turn);
    Ok(fence)
}

/// [`fence`] without a turn: the placement pass's read for its mend, which lists the
/// whole cluster after it and must not hold creates back meanwhile (its write, raced,
/// is left to the next pass).
pub async fn fence_outside_turns(store: &dyn Store) -> Result<Fence, StoreError> {
    let found = store.get(Kind::Meta, FENCE_KEY).await?;
    let (kept, expect) = match found {
        Some(d) => (
            serde_json::from_value::<Totals>(d.value).ok(),
            Expect::Version(d.version),
        ),
        None => (None, Expect::Absent),
    };
    let totals = match kept {
        Some(t) => t,
        None => Totals {
            shards: shards_held(store, "").await?,
            denials: store.list(Kind::Denial, "").await?.len() as u64,
        },
    };
    Ok(Fence {
        _turn: None,
        totals,
        expect,
        kept: kept.is_some(),
    })
}

/// Whether a denial kept until `until` (s since the epoch) still refuses its token at
/// `now` (s): until then and the clock skew a token is allowed past its expiry.
pub fn denial_in_force(until: u64, now: u64) -> bool {
    until.saturating_add(felix_wire::token::SKEW_SECS) >= now
}

/// Lapsed denials the placement pass drops in one batch: each is two round trips
/// under the Postgres store's write lock, and the batch has 20 s.
const MEND_DROPS_MAX: usize = 256;

/// The placement pass's mend of the kept totals, which writes outside this control
/// plane's own handlers (an instance of an older version beside it during an upgrade)
/// could have moved from the truth: `shards` is the sum the pass just listed, after
/// reading `fence`; and once the kept denial total reaches half the cluster's bound,
/// lapsed denials are dropped ([`MEND_DROPS_MAX`] a pass) and the rest counted.
/// Nothing is written when the kept totals hold; a write that raced another is left to
/// the next pass.
pub async fn mend(
    store: &dyn Store,
    fence: Fence,
    shards: u64,
    now: u64,
) -> Result<(), StoreError> {
    let mut totals = Totals {
        shards,
        ..fence.totals
    };
    let mut ops = Vec::new();
    if fence.totals.denials >= CLUSTER_DENIALS_MAX / 2 {
        let stored = store.list(Kind::Denial, "").await?;
        for d in &stored {
            let until = d.value["until"].as_u64().unwrap_or(u64::MAX);
            if ops.len() < MEND_DROPS_MAX && !denial_in_force(until, now) {
                ops.push(Op::Delete {
                    kind: Kind::Denial,
                    key: d.key.clone(),
                    expect: Expect::Version(d.version),
                });
            }
        }
        totals.denials = (stored.len() - ops.len()) as u64;
    }
    if fence.kept && totals == fence.totals {
        return Ok(());
    }
    ops.insert(0, fence.write(totals));
    match store.batch(ops).await {
        Ok(_) | Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Shards of the streams and caches whose keys start with `prefix` (`"{tenant}/"`).
pub async fn shards_held(store: &dyn Store, prefix: &str) -> Result<u64, StoreError> {
    let mut held = 0;
    for kind in [Kind::Stream, Kind::Cache] {
        held += store
            .list(kind, prefix)
            .await?
            .iter()
            .map(|d| shards_of(&d.value))
            .sum::<u64>();
    }
    Ok(held)
}

/// A stream's or cache's shard count (its creation fields are flattened into it; a
/// cache written without one has one, as it reads).
pub fn shards_of(v: &Value) -> u64 {
    v["shards"].as_u64().unwrap_or(1)
}

/// Whether `tenant`, holding `held` shards, may create `adding` more while the cluster
/// holds `cluster`.
pub fn room_for_shards(
    tenant: &str,
    held: u64,
    cluster: u64,
    adding: u32,
) -> Result<(), OverLimit> {
    let adding = u64::from(adding);
    if held + adding > TENANT_SHARDS_MAX {
        Err(OverLimit(format!(
            "tenant {tenant} holds {held} shards and may hold at most \
             {TENANT_SHARDS_MAX}: {adding} more do not fit (delete a stream or cache first)"
        )))
    } else if cluster + adding > CLUSTER_SHARDS_MAX {
        Err(OverLimit(format!(
            "the cluster holds {cluster} shards and may hold at most \
             {CLUSTER_SHARDS_MAX} (every broker reads all of their assignments at once): \
             {adding} more do not fit"
        )))
    } else {
        Ok(())
    }
}

/// Whether `tenant`, holding `in_force` denials in force, may hold one more while the
/// cluster would store `stored` denials with it.
pub fn room_for_denial(tenant: &str, in_force: usize, stored: u64) -> Result<(), OverLimit> {
    if in_force >= TENANT_DENIALS_MAX {
        Err(OverLimit(format!(
            "tenant {tenant} holds {in_force} denials in force, the most it may: retire \
             the signing key of the tokens to revoke instead"
        )))
    } else if stored > CLUSTER_DENIALS_MAX {
        Err(OverLimit(format!(
            "the cluster would store {stored} denials, more than the {CLUSTER_DENIALS_MAX} \
             it may (every broker reads them all at once)"
        )))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One control plane's counted writes take turns from the fence read until the
    /// fence is dropped; the placement pass's read takes none, and another control
    /// plane's turns are its own.
    #[tokio::test]
    async fn counted_writes_take_turns_until_their_fence_is_dropped() {
        let store = crate::store::MemoryStore::new();
        let (turns, others) = (Turns::default(), Turns::default());
        let first = fence(&store, &turns).await.unwrap();
        let waits = std::time::Duration::from_millis(50);
        assert!(
            tokio::time::timeout(waits, fence(&store, &turns))
                .await
                .is_err(),
            "a second counted write waits for the first's turn"
        );
        fence_outside_turns(&store).await.unwrap();
        drop(
            tokio::time::timeout(waits, fence(&store, &others))
                .await
                .unwrap(),
        );
        drop(first);
        tokio::time::timeout(waits, fence(&store, &turns))
            .await
            .expect("the turn passes on once the fence is dropped")
            .unwrap();
    }

    /// A write that waits past its bound for its turn (the one before it stalled on the
    /// store) fails `Unavailable` rather than queueing for good.
    #[tokio::test]
    async fn a_turn_waited_for_too_long_is_unavailable() {
        let store = crate::store::MemoryStore::new();
        let turns = Turns {
            wait_max: std::time::Duration::from_millis(20),
            ..Turns::default()
        };
        let _stalled = fence(&store, &turns).await.unwrap();
        let e = fence(&store, &turns).await.unwrap_err();
        assert!(
            matches!(&e, StoreError::Unavailable(m) if m.contains("turn")),
            "{e:?}"
        );
    }

    /// A denial is refused past the tenant's bound, and past the cluster's though the
    /// tenant holds none.
    #[test]
    fn denials_count_against_the_tenant_and_the_cluster() {
        assert!(room_for_denial("acme", TENANT_DENIALS_MAX - 1, 1).is_ok());
        let e = room_for_denial("acme", TENANT_DENIALS_MAX, 1).unwrap_err();
        assert!(e.0.contains("tenant acme"), "{e:?}");
        assert!(room_for_denial("beta", 0, CLUSTER_DENIALS_MAX).is_ok());
        let e = room_for_denial("beta", 0, CLUSTER_DENIALS_MAX + 1).unwrap_err();
        assert!(e.0.contains("the cluster would store 16385"), "{e:?}");
    }

    /// Shards are refused past the tenant's bound, and past the cluster's though the
    /// tenant holds none.
    #[test]
    fn shards_count_against_the_tenant_and_the_cluster() {
        assert!(room_for_shards("acme", TENANT_SHARDS_MAX - 1, 0, 1).is_ok());
        assert!(room_for_shards("acme", TENANT_SHARDS_MAX - 1, 0, 2).is_err());
        assert!(room_for_shards("beta", 0, CLUSTER_SHARDS_MAX - 4096, 4096).is_ok());
        let e = room_for_shards("beta", 0, CLUSTER_SHARDS_MAX - 4095, 4096).unwrap_err();
        assert!(e.0.contains("the cluster holds"), "{e:?}");
    }
}
