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
//! Two creates at once could each count before the other wrote; every counted create
//! rewrites one fence document at the version it read before counting, so the later
//! of the two fails its batch, counts again and is judged on what the other wrote.

use serde_json::{Value, json};

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
/// Denials in force the whole cluster may hold.
pub const CLUSTER_DENIALS_MAX: usize = 16_384;

/// The `Meta` key of the fence document.
const FENCE_KEY: &str = "limits-fence";

/// Why a create was refused: what is held, what the bound is, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverLimit(pub String);

/// The fence write a counted create adds to its batch, read *before* it counts: a
/// counted create that wrote meanwhile moved its version, so this batch fails and the
/// caller counts again.
pub async fn fence(store: &dyn Store) -> Result<Op, StoreError> {
    let expect = match store.get(Kind::Meta, FENCE_KEY).await? {
        Some(d) => Expect::Version(d.version),
        None => Expect::Absent,
    };
    Ok(Op::Put {
        kind: Kind::Meta,
        key: FENCE_KEY.to_owned(),
        value: json!({}),
        expect,
    })
}

/// Whether `tenant` may create `adding` more shards: the streams and caches held now,
/// the tenant's and everyone's, counted against [`TENANT_SHARDS_MAX`] and
/// [`CLUSTER_SHARDS_MAX`].
pub async fn room_for_shards(
    store: &dyn Store,
    tenant: &str,
    adding: u32,
) -> Result<Result<(), OverLimit>, StoreError> {
    let mine = format!("{tenant}/");
    let (mut tenants, mut cluster) = (0u64, 0u64);
    for kind in [Kind::Stream, Kind::Cache] {
        for d in store.list(kind, "").await? {
            let shards = shards_of(&d.value);
            cluster += shards;
            if d.key.starts_with(&mine) {
                tenants += shards;
            }
        }
    }
    let adding = u64::from(adding);
    Ok(if tenants + adding > TENANT_SHARDS_MAX {
        Err(OverLimit(format!(
            "tenant {tenant} holds {tenants} shards and may hold at most \
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
    })
}

/// A stream's or cache's shard count (its creation fields are flattened into it; a
/// cache written without one has one, as it reads).
fn shards_of(v: &Value) -> u64 {
    v["shards"].as_u64().unwrap_or(1)
}

/// Whether `tenant` may hold one more denial in force, given the denials in force now
/// (`(tenant, jti)` each).
pub fn room_for_denial<'a>(
    in_force: impl IntoIterator<Item = &'a str>,
    tenant: &str,
) -> Result<(), OverLimit> {
    let (mut tenants, mut cluster) = (0usize, 0usize);
    for t in in_force {
        cluster += 1;
        if t == tenant {
            tenants += 1;
        }
    }
    if tenants >= TENANT_DENIALS_MAX {
        Err(OverLimit(format!(
            "tenant {tenant} holds {tenants} denials in force, the most it may: retire \
             the signing key of the tokens to revoke instead"
        )))
    } else if cluster >= CLUSTER_DENIALS_MAX {
        Err(OverLimit(format!(
            "the cluster holds {cluster} denials in force, the most it may (every broker \
             reads them all at once)"
        )))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A denial is refused past the tenant's bound, and past the cluster's though the
    /// tenant holds none.
    #[test]
    fn denials_count_against_the_tenant_and_the_cluster() {
        let mine = vec!["acme"; TENANT_DENIALS_MAX - 1];
        assert!(room_for_denial(mine.iter().copied(), "acme").is_ok());
        let full = vec!["acme"; TENANT_DENIALS_MAX];
        let e = room_for_denial(full.iter().copied(), "acme").unwrap_err();
        assert!(e.0.contains("tenant acme"), "{e:?}");
        assert!(room_for_denial(full.iter().copied(), "beta").is_ok());

        let others: Vec<String> = (0..CLUSTER_DENIALS_MAX).map(|i| format!("t{i}")).collect();
        let e = room_for_denial(others.iter().map(String::as_str), "acme").unwrap_err();
        assert!(e.0.contains("the cluster"), "{e:?}");
        assert!(room_for_denial(others[1..].iter().map(String::as_str), "acme").is_ok());
    }
}
