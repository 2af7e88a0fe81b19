//! Token verification for client streams: see [`felix_wire::token`].

pub use felix_wire::token::{
    Action, AuthError, BROKER_AUDIENCE, Claims, Grant, ISSUER, SigningKey, TenantKeys,
    all_data_perms,
};

/// Seconds since the epoch.
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
