//! Key-to-shard routing, part of the protocol: a client that routes keyed publishes
//! itself must agree with every broker bit for bit.
//!
//! The key hash is FNV-1a 64 followed by a splitmix64 finalizer. A stream maps the hash
//! to a shard by `modulo` (the default) or by Lamping-Veach jump consistent hashing, fixed
//! when the stream is created. No key, or one shard, is always shard 0.

use serde::{Deserialize, Serialize};

use crate::ids::ShardId;

const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
const JUMP_MULTIPLIER: u64 = 2_862_933_555_777_941_757;

/// How a stream maps key hashes to shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardRouting {
    /// `hash % shards`.
    #[default]
    Modulo,
    /// Jump consistent hash: adding a shard moves only `1/n` of the keys.
    JumpHash,
}

/// FNV-1a 64 of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv1a64_update(FNV_OFFSET_BASIS, bytes)
}

/// Continues an FNV-1a 64 hash `h` (start from [`fnv1a64`] of the first part) over
/// `bytes`: the project's one FNV, for keys, placement and rendezvous scores alike.
pub fn fnv1a64_update(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, b| (h ^ u64::from(*b)).wrapping_mul(FNV_PRIME))
}

/// The splitmix64 finalizer: spreads FNV's weak low bits over the whole word.
pub fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The routing hash of a key.
pub fn key_hash(key: &[u8]) -> u64 {
    finalize(fnv1a64(key))
}

/// Lamping-Veach jump consistent hash, with the published float arithmetic.
pub fn jump_hash(mut key: u64, buckets: u32) -> u32 {
    let buckets = i64::from(buckets);
    let mut b: i64 = -1;
    let mut j: i64 = 0;
    while j < buckets {
        b = j;
        key = key.wrapping_mul(JUMP_MULTIPLIER).wrapping_add(1);
        j = ((b + 1) as f64 * ((1u64 << 31) as f64 / ((key >> 33) + 1) as f64)) as i64;
    }
    // b is in 0..buckets (or -1 for zero buckets, which callers exclude).
    b.max(0) as u32
}

/// The shard a record with this key (or no key) goes to.
pub fn shard_for_key(key: Option<&[u8]>, shards: u32, routing: ShardRouting) -> ShardId {
    let Some(key) = key else {
        return ShardId(0);
    };
    if shards <= 1 {
        return ShardId(0);
    }
    let hash = key_hash(key);
    ShardId(match routing {
        ShardRouting::Modulo => (hash % u64::from(shards)) as u32,
        ShardRouting::JumpHash => jump_hash(hash, shards),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_known_answers() {
        assert_eq!(fnv1a64(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a64(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x85944171f73967e8);
    }

    #[test]
    fn finalizer_matches_splitmix64_outputs() {
        // splitmix64 seeded with 0 yields finalize(k * golden) for k = 1, 2, 3.
        let golden = 0x9e3779b97f4a7c15u64;
        assert_eq!(finalize(golden), 0xe220a8397b1dcdaf);
        assert_eq!(finalize(golden.wrapping_mul(2)), 0x6e789e6aa1b965f4);
        assert_eq!(finalize(golden.wrapping_mul(3)), 0x06c45d188009454f);
    }

    #[test]
    fn jump_hash_known_answers() {
        assert_eq!(jump_hash(1, 1), 0);
        assert_eq!(jump_hash(42, 57), 43);
        assert_eq!(jump_hash(256, 1024), 520);
        assert_eq!(jump_hash(3735883980, 1), 0);
        assert_eq!(jump_hash(3735883980, 666), 361);
        assert_eq!(jump_hash(16045690984833335023, 255), 237);
    }

    #[test]
    fn no_key_or_one_shard_is_shard_zero() {
        for routing in [ShardRouting::Modulo, ShardRouting::JumpHash] {
            assert_eq!(shard_for_key(None, 16, routing), ShardId(0));
            assert_eq!(shard_for_key(Some(b"k"), 1, routing), ShardId(0));
            assert_eq!(shard_for_key(Some(b"k"), 0, routing), ShardId(0));
        }
    }

    #[test]
    fn keyed_routing_composes_hash_and_mapping() {
        let h = key_hash(b"order-17");
        assert_eq!(
            shard_for_key(Some(b"order-17"), 4, ShardRouting::Modulo),
            ShardId((h % 4) as u32)
        );
        assert_eq!(
            shard_for_key(Some(b"order-17"), 4, ShardRouting::JumpHash),
            ShardId(jump_hash(h, 4))
        );
        // The empty key is a real key, not "unkeyed".
        assert_eq!(key_hash(b""), finalize(0xcbf29ce484222325));
    }

    #[test]
    fn jump_hash_moves_few_keys_when_a_shard_is_added() {
        let moved = (0..10_000u64)
            .filter(|k| {
                jump_hash(key_hash(&k.to_be_bytes()), 8) != jump_hash(key_hash(&k.to_be_bytes()), 9)
            })
            .count();
        assert!((800..1500).contains(&moved), "about 1/9 move, got {moved}");
    }
}
