//! Token verification for client streams: see [`felix_wire::token`].

pub use felix_wire::token::{
    Action, AuthError, BROKER_AUDIENCE, Claims, Grant, ISSUER, SigningKey, TenantKeys,
    all_data_perms,
};
