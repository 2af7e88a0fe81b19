//! The REST API (axum): every handler authenticates, authorizes, validates, then makes
//! one atomic store batch, so the store is never left half-written.
//!
//! Errors are JSON `{code, message, field?}` with 400 (validation, naming the field),
//! 401 (no or bad token), 403 (missing permission), 404, 409 (conflict or version
//! mismatch), 413 (body over 64 KiB), 503 (store unavailable).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use felix_wire::token::{
    CONTROLPLANE_AUDIENCE, Claims, Grant, ISSUER, Jwk, SigningKey, TenantKeys,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::limits;
use crate::model::*;
use crate::placement;
use crate::replication::{ReplicaReports, ReplicaStatus, StoredReport, Verdict};
use crate::sealing::{Keyring, Sealed};
use crate::store::{Doc, Expect, Kind, Op, Store, StoreError};

use base64 as b64;

/// Largest request body.
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// Longest a request's body may take to arrive once its handler reads it (after the
/// token is checked): a caller that
/// stopped sending (or a connection half-open mid-body) held its connection, one of
/// `bounded::API`'s, for as long as TCP took to notice.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// Service settings.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Enables `POST /internal/bootstrap` with this token.
    pub bootstrap_token: Option<String>,
    /// How often nodes heartbeat.
    pub heartbeat_interval: Duration,
    /// The lease a heartbeat buys, told to brokers: a broker keeps it for
    /// `expiry_timeout - expiry_timeout/4` from the instant it *sent* the heartbeat.
    pub expiry_timeout: Duration,
    /// Extra silence, beyond the expiry, before a node is marked down and its shards
    /// may go to someone else (`None`: a quarter of the expiry, the least allowed).
    /// It absorbs clock-rate drift and the broker's own give-up margin, so the old
    /// leader has stopped writing before a successor is named.
    pub regrant_margin: Option<Duration>,
    /// How long a replica-set member may be down before it is replaced.
    pub replica_restore_after: Duration,
    /// Serve `POST /debug/clock` (steps this process's wall clock; tests and chaos
    /// runs only).
    pub fault_injection: bool,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            bootstrap_token: None,
            heartbeat_interval: Duration::from_secs(1),
            expiry_timeout: Duration::from_secs(5),
            regrant_margin: None,
            replica_restore_after: Duration::from_secs(60),
            fault_injection: false,
        }
    }
}

impl ApiConfig {
    /// The regrant margin in force: the configured one, or a quarter of the expiry.
    pub fn regrant_margin(&self) -> Duration {
        self.regrant_margin.unwrap_or(self.expiry_timeout / 4)
    }

    /// Silence after which a node is marked down: the expiry plus the regrant margin.
    pub fn down_after(&self) -> Duration {
        self.expiry_timeout + self.regrant_margin()
    }

    /// How long a replica report stays usable: `2 × expiry + heartbeat_interval`.
    pub fn report_ttl(&self) -> Duration {
        self.expiry_timeout * 2 + self.heartbeat_interval
    }

    /// Refuses a margin below a quarter of the expiry: the broker gives up its lease a
    /// quarter early, and a smaller margin would let a successor start before that.
    pub fn check_margin(&self) -> Result<(), String> {
        match self.regrant_margin {
            Some(m) if m * 4 < self.expiry_timeout => Err(format!(
                "regrant margin {m:?} is below a quarter of the expiry ({:?})",
                self.expiry_timeout
            )),
            _ => Ok(()),
        }
    }
}

/// Shared handler state.
#[derive(Debug, Clone)]
pub struct AppState {
    /// The store.
    pub store: Arc<dyn Store>,
    /// Settings.
    pub config: ApiConfig,
    /// The latest replica report per shard (memory only).
    pub reports: ReplicaReports,
    /// Seals and opens tenants' private signing keys.
    pub keyring: Arc<Keyring>,
    /// This control plane's counted writes take turns (see [`limits::Turns`]).
    pub counted: limits::Turns,
    /// Audit entries this control plane has written (every [`AUDIT_PRUNE_EVERY`]th
    /// prunes the log, unless a prune is still running: `auditing`).
    pub audited: Arc<std::sync::atomic::AtomicU64>,
    /// A prune of the audit log is running.
    pub auditing: Arc<std::sync::atomic::AtomicBool>,
}

/// An API error.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    field: Option<String>,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            field: None,
        }
    }

    fn invalid(field: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            field: Some(field.to_owned()),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid", message)
        }
    }

    fn unauthenticated(m: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthenticated", m)
    }

    fn forbidden(m: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::FORBIDDEN, "forbidden", m)
    }

    fn not_found(m: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", m)
    }

    fn conflict(m: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, "conflict", m)
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Conflict { .. } => ApiError::conflict(e.to_string()),
            StoreError::NotFound { .. } => ApiError::not_found(e.to_string()),
            StoreError::Unavailable(m) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", m)
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = json!({"code": self.code, "message": self.message});
        if let Some(f) = self.field {
            body["field"] = Value::String(f);
        }
        (self.status, Json(body)).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// A step injected into this process's wall clock (`POST /debug/clock`).
static WALL_STEP_MS: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

fn system_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Wall-clock milliseconds since the epoch: for what is about calendar time (token
/// lifetimes, key ids, event stamps). It steps when the host's clock does.
pub fn now_ms() -> u64 {
    system_ms().saturating_add_signed(WALL_STEP_MS.load(std::sync::atomic::Ordering::Relaxed))
}

/// Milliseconds on a clock that never steps: the wall clock read once, then a
/// monotonic clock. Heartbeat silence and report ages are measured on it, so a step of
/// the host's clock neither declares live brokers down (naming a second leader while
/// the first still holds its lease) nor keeps silent ones up. Stored heartbeat times
/// are on it too; after a restart they compare against a new reading of the wall
/// clock, which only a step between the two runs can skew.
pub fn liveness_ms() -> u64 {
    let (wall, at) = liveness_base();
    wall + at.elapsed().as_millis() as u64
}

/// When this process's liveness clock began, on that clock: stamps older than it were
/// written by an earlier process, on a clock that may have run behind (see
/// [`crate::placement::standing`]).
pub fn liveness_started_ms() -> u64 {
    liveness_base().0
}

fn liveness_base() -> (u64, std::time::Instant) {
    static BASE: std::sync::OnceLock<(u64, std::time::Instant)> = std::sync::OnceLock::new();
    *BASE.get_or_init(|| (system_ms(), std::time::Instant::now()))
}

/// `POST /debug/clock {"step_ms": n}`: steps the wall clock of this process by `n` ms
/// (negative: back), as an operator's mistake or a bad NTP server would.
async fn debug_clock(body: axum::body::Bytes) -> ApiResult<Json<Value>> {
    let v: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", e.to_string()))?;
    let step = v["step_ms"].as_i64().ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "step_ms: an integer",
        )
    })?;
    let total = WALL_STEP_MS.fetch_add(step, std::sync::atomic::Ordering::Relaxed) + step;
    Ok(Json(json!({"step_ms": total})))
}

/// Reads and parses a JSON body with the size limit, naming the bad field.
async fn body<T: DeserializeOwned>(b: Body) -> ApiResult<T> {
    body_within(b, BODY_TIMEOUT).await
}

/// [`body`], with the time it may take to arrive.
async fn body_within<T: DeserializeOwned>(b: Body, within: Duration) -> ApiResult<T> {
    let bytes: Bytes = tokio::time::timeout(within, axum::body::to_bytes(b, MAX_BODY_BYTES))
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "timeout",
                format!("request body not received within {within:?}"),
            )
        })?
        .map_err(|_| {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!("request body over {MAX_BODY_BYTES} bytes"),
            )
        })?;
    let invalid = |e: serde_json::Error| {
        let msg = e.to_string();
        let field = msg
            .split('`')
            .nth(1)
            .filter(|_| msg.contains("field"))
            .unwrap_or("body")
            .to_owned();
        ApiError::invalid(&field, msg)
    };
    let value: Value = serde_json::from_slice(&bytes).map_err(invalid)?;
    // Postgres stores documents as JSONB, which refuses U+0000: a NUL in a token's
    // subject, a display name or a reason made the write (or its audit entry, which
    // then went missing) fail as `unavailable`, and the memory store took it. Refused
    // here, the same on every store.
    if holds_nul(&value) {
        return Err(ApiError::invalid(
            "body",
            "strings may not contain U+0000 (NUL)",
        ));
    }
    serde_json::from_value(value).map_err(invalid)
}

/// Whether any string of `v`, or any key, contains U+0000.
fn holds_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(a) => a.iter().any(holds_nul),
        Value::Object(o) => o.iter().any(|(k, v)| k.contains('\0') || holds_nul(v)),
        _ => false,
    }
}

fn name(field: &str, v: &str) -> ApiResult<()> {
    if valid_name(v) {
        Ok(())
    } else {
        Err(ApiError::invalid(
            field,
            format!("{field} {v:?} must be 1-128 of [A-Za-z0-9-_.], starting alphanumeric"),
        ))
    }
}

/// The longest display name, in bytes: a cache's goes into the streams snapshot every
/// broker reads whole (one of 64 KiB, the largest body, a cache, took 1,000 caches to
/// reach what a broker reads).
pub const DISPLAY_NAME_MAX_BYTES: usize = 256;

fn display_name(v: &str) -> ApiResult<()> {
    if v.len() <= DISPLAY_NAME_MAX_BYTES {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "display_name",
            format!("at most {DISPLAY_NAME_MAX_BYTES} bytes"),
        ))
    }
}

fn to<T: DeserializeOwned>(d: &Doc) -> ApiResult<T> {
    serde_json::from_value(d.value.clone()).map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("stored {}: {e}", d.key),
        )
    })
}

fn val<T: Serialize>(v: &T) -> Value {
    serde_json::to_value(v).expect("resources serialize")
}

// ---- Keys and tokens ----------------------------------------------------------------

/// A tenant's signing key as stored: the public half in clear, the private half sealed
/// with the keyring's current KEK (`crate::sealing`).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StoredKey {
    kid: String,
    /// The raw Ed25519 public key, base64url without padding (a JWK's `x`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    public: Option<String>,
    /// The PKCS#8 private key, sealed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sealed: Option<Sealed>,
    /// The PKCS#8 private key in clear base64, as versions before sealing stored it;
    /// sealed (and removed) when the service starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pkcs8: Option<String>,
    /// Whether new tokens are signed with it (one per tenant).
    active: bool,
    #[serde(default)]
    created_ms: u64,
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
}

impl StoredKey {
    fn new(keyring: &Keyring, tenant: &str, key: &SigningKey, active: bool) -> StoredKey {
        StoredKey {
            kid: key.kid.clone(),
            public: Some(b64::engine::general_purpose::URL_SAFE_NO_PAD.encode(key.public_key())),
            sealed: Some(keyring.seal(&format!("{tenant}/{}", key.kid), key.pkcs8())),
            pkcs8: None,
            active,
            created_ms: now_ms(),
        }
    }

    /// The raw public key (from a legacy clear row, the private key's public half).
    fn public_key(&self) -> ApiResult<Vec<u8>> {
        if let Some(x) = &self.public {
            return b64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(x)
                .map_err(internal);
        }
        let pkcs8 = self
            .clear_pkcs8()
            .ok_or_else(|| internal(format!("signing key {} has no public key", self.kid)))??;
        Ok(SigningKey::from_pkcs8(&pkcs8, &self.kid)
            .map_err(internal)?
            .public_key())
    }

    fn clear_pkcs8(&self) -> Option<ApiResult<Vec<u8>>> {
        self.pkcs8.as_ref().map(|p| {
            b64::engine::general_purpose::STANDARD
                .decode(p)
                .map_err(internal)
        })
    }

    /// The private key, opened with `keyring`.
    fn open(&self, keyring: &Keyring, tenant: &str) -> ApiResult<SigningKey> {
        let pkcs8 = match (&self.sealed, self.clear_pkcs8()) {
            (Some(sealed), _) => keyring
                .open(&format!("{tenant}/{}", self.kid), sealed)
                .map_err(internal)?,
            (None, Some(clear)) => clear?,
            (None, None) => return Err(internal(format!("signing key {} is empty", self.kid))),
        };
        SigningKey::from_pkcs8(&pkcs8, &self.kid).map_err(internal)
    }
}

/// A tenant's verification keys (public halves only; nothing is opened).
async fn tenant_keys(store: &dyn Store, tenant: &str) -> ApiResult<TenantKeys> {
    let mut keys = TenantKeys::default();
    for d in store.list(Kind::SigningKey, &format!("{tenant}/")).await? {
        let k: StoredKey = to(&d)?;
        keys.add(tenant, &k.kid, k.public_key()?);
    }
    Ok(keys)
}

/// The tenant's active signing key, opened.
async fn active_key(st: &AppState, tenant: &str) -> ApiResult<SigningKey> {
    for d in st
        .store
        .list(Kind::SigningKey, &format!("{tenant}/"))
        .await?
    {
        let k: StoredKey = to(&d)?;
        if k.active {
            return k.open(&st.keyring, tenant);
        }
    }
    Err(ApiError::not_found(format!(
        "tenant {tenant} has no active signing key"
    )))
}

fn random_hex(bytes: usize) -> String {
    use ring::rand::SecureRandom as _;
    let mut b = vec![0u8; bytes];
    ring::rand::SystemRandom::new()
        .fill(&mut b)
        .expect("the system random source");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The most signing keys a tenant holds: brokers refuse a key set of more
/// (`felix_broker::cluster::JWKS_MAX_KEYS`) and keep the tenant's last one, so past it
/// a retirement would never reach them.
pub const SIGNING_KEYS_MAX: usize = 64;

/// The longest tenant-id prefix a key id carries: brokers refuse key ids over 128
/// bytes, and the rest of the id takes 21.
const KID_TENANT_PREFIX_MAX: usize = 64;

fn new_key_op(keyring: &Keyring, tenant: &str, active: bool) -> ApiResult<(Op, SigningKey)> {
    // Tenant ids are ASCII: any byte boundary is a character boundary.
    let prefix = &tenant[..tenant.len().min(KID_TENANT_PREFIX_MAX)];
    let kid = format!("{prefix}-{}-{}", now_ms(), random_hex(3));
    let key = SigningKey::generate(&kid).map_err(internal)?;
    Ok((
        Op::Put {
            kind: Kind::SigningKey,
            key: format!("{tenant}/{kid}"),
            value: val(&StoredKey::new(keyring, tenant, &key, active)),
            expect: Expect::Absent,
        },
        key,
    ))
}

/// Seals with the current KEK every signing key stored in clear or sealed with a
/// previous KEK; refuses (naming the row and KEK) one sealed with a KEK not configured.
/// Returns how many rows it rewrote.
pub async fn reseal_keys(store: &dyn Store, keyring: &Keyring) -> anyhow::Result<usize> {
    let mut rewritten = 0;
    for d in store.list(Kind::SigningKey, "").await? {
        let k: StoredKey = serde_json::from_value(d.value.clone())?;
        let stale = match &k.sealed {
            Some(s) => keyring.stale(&s.kek),
            None => true,
        };
        if !stale {
            continue;
        }
        let Some((tenant, _)) = d.key.split_once('/') else {
            anyhow::bail!("signing key row {:?} is not tenant/kid", d.key);
        };
        let key = k
            .open(keyring, tenant)
            .map_err(|e| anyhow::anyhow!("{}", e.message))?;
        let resealed = StoredKey {
            created_ms: k.created_ms,
            ..StoredKey::new(keyring, tenant, &key, k.active)
        };
        store
            .batch(vec![Op::Put {
                kind: Kind::SigningKey,
                key: d.key.clone(),
                value: val(&resealed),
                expect: Expect::Version(d.version),
            }])
            .await?;
        rewritten += 1;
    }
    Ok(rewritten)
}

/// A token of `tenant` signed by `key`, issued at `now` and expiring at `exp` (s since
/// the epoch), with a fresh id: the token and its id.
fn sign(
    key: &SigningKey,
    tenant: &str,
    sub: &str,
    audience: &str,
    perms: Vec<String>,
    (now, exp): (u64, u64),
) -> (String, String) {
    let jti = random_hex(16);
    let token = key.sign(&Claims {
        iss: ISSUER.into(),
        aud: audience.into(),
        sub: sub.into(),
        tid: tenant.into(),
        iat: now,
        exp,
        nbf: None,
        perms,
        jti: Some(jti.clone()),
    });
    (token, jti)
}

/// Authenticates the bearer token (control-plane audience) against its tenant's keys.
async fn authenticate(st: &AppState, headers: &HeaderMap) -> ApiResult<Grant> {
    let token = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| ApiError::unauthenticated("missing Authorization: Bearer token"))?;
    let tenant = TenantKeys::claimed_tenant(token)
        .ok_or_else(|| ApiError::unauthenticated("malformed token"))?;
    let keys = tenant_keys(st.store.as_ref(), &tenant).await?;
    let grant = keys
        .verify_for(token, &tenant, now_ms() / 1000, CONTROLPLANE_AUDIENCE)
        .map_err(|e| ApiError::unauthenticated(e.to_string()))?;
    if let Some(jti) = &grant.jti
        && denied(st.store.as_ref(), &tenant, jti).await?
    {
        return Err(ApiError::unauthenticated(format!("token {jti} is revoked")));
    }
    // Cluster-scope permissions mean something only from the operator tenant.
    if tenant != OPERATOR_TENANT && grant.perm_strings().iter().any(|p| operator_only(p)) {
        return Err(ApiError::forbidden(
            "cluster and node permissions are only valid in operator tokens",
        ));
    }
    Ok(grant)
}

/// Permissions only the operator tenant's tokens may carry.
fn operator_only(perm: &str) -> bool {
    matches!(perm.split(':').nth(1), Some("cluster" | "node"))
}

fn require(grant: &Grant, action: &str, kind: &str, path: &[&str]) -> ApiResult<()> {
    if grant.allows_object(action, kind, path) {
        Ok(())
    } else {
        Err(ApiError::forbidden(format!(
            "requires {action} on {kind}:{}",
            path.join("/")
        )))
    }
}

// ---- Handlers -----------------------------------------------------------------------

async fn live() -> Json<Value> {
    Json(json!({"status": "live"}))
}

async fn ready(State(st): State<AppState>) -> ApiResult<Json<Value>> {
    st.store.ping().await?;
    Ok(Json(json!({"status": "ready"})))
}

async fn openapi() -> Response {
    (
        [("content-type", "application/json")],
        include_str!("../openapi.json"),
    )
        .into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BootstrapBody {
    #[serde(default = "admin")]
    principal: String,
}

fn admin() -> String {
    "operator-admin".into()
}

async fn bootstrap(
    State(st): State<AppState>,
    headers: HeaderMap,
    b: Body,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let Some(expected) = &st.config.bootstrap_token else {
        return Err(ApiError::not_found("bootstrap is disabled"));
    };
    let given = headers
        .get("x-felix-bootstrap-token")
        .and_then(|v| v.to_str().ok());
    if !given.is_some_and(|g| same_secret(g.as_bytes(), expected.as_bytes())) {
        return Err(ApiError::unauthenticated(
            "wrong or missing X-Felix-Bootstrap-Token",
        ));
    }
    let req: BootstrapBody = body(b).await?;
    let (key_op, key) = new_key_op(&st.keyring, OPERATOR_TENANT, true)?;
    st.store
        .batch(vec![
            Op::Put {
                kind: Kind::Meta,
                key: "bootstrap".into(),
                value: json!({"at_ms": now_ms()}),
                expect: Expect::Absent,
            },
            Op::Put {
                kind: Kind::Tenant,
                key: OPERATOR_TENANT.into(),
                value: val(&Tenant {
                    tenant_id: OPERATOR_TENANT.into(),
                    display_name: "Operators".into(),
                }),
                expect: Expect::Absent,
            },
            key_op,
        ])
        .await
        .map_err(|e| match e {
            StoreError::Conflict { .. } => ApiError::conflict("already initialized"),
            other => other.into(),
        })?;
    let perms = vec![
        "tenant.manage:cluster:*".to_owned(),
        "node.manage:cluster:*".to_owned(),
        "node.view:cluster:*".to_owned(),
    ];
    let now = now_ms() / 1000;
    let (token, _) = sign(
        &key,
        OPERATOR_TENANT,
        &req.principal,
        CONTROLPLANE_AUDIENCE,
        perms,
        (now, now + 365 * 24 * 3600),
    );
    Ok((
        StatusCode::OK,
        Json(json!({"token": token, "kid": key.kid, "tenant_id": OPERATOR_TENANT})),
    ))
}

async fn list_tenants(State(st): State<AppState>, h: HeaderMap) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "tenant.manage", "cluster", &["*"])?;
    let items: Vec<Tenant> = st
        .store
        .list(Kind::Tenant, "")
        .await?
        .iter()
        .map(to)
        .collect::<ApiResult<_>>()?;
    Ok(Json(json!({"items": items})))
}

async fn tenants_snapshot(State(st): State<AppState>, h: HeaderMap) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "node.view", "cluster", &["*"])?;
    // The change log's position, as the assignments' snapshot answers it (tenants are
    // not in the log: nothing follows them from here; brokers read the whole list).
    let next_seq = st.store.head().await?;
    let items: Vec<Tenant> = st
        .store
        .list(Kind::Tenant, "")
        .await?
        .iter()
        .map(to)
        .collect::<ApiResult<_>>()?;
    Ok(Json(json!({"items": items, "next_seq": next_seq})))
}

async fn create_tenant(
    State(st): State<AppState>,
    h: HeaderMap,
    b: Body,
) -> ApiResult<(StatusCode, Json<Tenant>)> {
    let g = authenticate(&st, &h).await?;
    require(&g, "tenant.manage", "cluster", &["*"])?;
    let t: Tenant = body::<TenantCreate>(b).await?.into();
    name("tenant_id", &t.tenant_id)?;
    display_name(&t.display_name)?;
    let (key_op, _) = new_key_op(&st.keyring, &t.tenant_id, true)?;
    st.store
        .batch(vec![
            Op::Put {
                kind: Kind::Tenant,
                key: t.tenant_id.clone(),
                value: val(&t),
                expect: Expect::Absent,
            },
            key_op,
        ])
        .await?;
    Ok((StatusCode::CREATED, Json(t)))
}

async fn delete_tenant(
    State(st): State<AppState>,
    h: HeaderMap,
    Path(t): Path<String>,
) -> ApiResult<StatusCode> {
    let g = authenticate(&st, &h).await?;
    require(&g, "tenant.manage", "cluster", &["*"])?;
    if t == OPERATOR_TENANT {
        // Its keys sign every operator and node token: deleted, no broker could
        // heartbeat, no operator act, and bootstrap answers "already initialized".
        return Err(ApiError::conflict(format!(
            "tenant {t} holds the cluster's keys and cannot be deleted"
        )));
    }
    let mut raced = 0;
    loop {
        // Creating a namespace rewrites its tenant: deleting at this version fails if
        // one was created after the emptiness check.
        let d = must_exist(&st, Kind::Tenant, &t).await?;
        if !st
            .store
            .list(Kind::Namespace, &format!("{t}/"))
            .await?
            .is_empty()
        {
            return Err(ApiError::conflict(format!(
                "tenant {t} still has namespaces"
            )));
        }
        // Its denials go with its keys (no token they signed verifies any more), and
        // leave the cluster's total in the same batch.
        let fence = limits::fence(st.store.as_ref(), &st.counted).await?;
        let denials = st.store.list(Kind::Denial, &format!("{t}/")).await?;
        let mut ops = vec![
            fence.write(limits::Totals {
                denials: fence.totals.denials.saturating_sub(denials.len() as u64),
                ..fence.totals
            }),
            Op::Delete {
                kind: Kind::Tenant,
                key: t.clone(),
                expect: Expect::Version(d.version),
            },
        ];
        for k in st.store.list(Kind::SigningKey, &format!("{t}/")).await? {
            ops.push(Op::Delete {
                kind: Kind::SigningKey,
                key: k.key,
                expect: Expect::Any,
            });
        }
        for n in denials {
            ops.push(Op::Delete {
                kind: Kind::Denial,
                key: n.key,
                expect: Expect::Version(n.version),
            });
        }
        match st.store.batch(ops).await {
            Ok(_) => return Ok(StatusCode::NO_CONTENT),
            Err(e) => raced_again(e, &mut raced, fence).await?,
        }
    }
}

async fn jwks(State(st): State<AppState>, Path(t): Path<String>) -> ApiResult<Json<Value>> {
    if st.store.get(Kind::Tenant, &t).await?.is_none() {
        return Err(ApiError::not_found(format!("tenant {t} not found")));
    }
    let mut keys = Vec::new();
    for d in st.store.list(Kind::SigningKey, &format!("{t}/")).await? {
        let k: StoredKey = to(&d)?;
        keys.push(Jwk::ed25519(&k.kid, &k.public_key()?));
    }
    Ok(Json(json!({"keys": keys})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenRequest {
    sub: String,
    audience: String,
    perms: Vec<String>,
    #[serde(default = "hour")]
    ttl_seconds: u64,
}

fn hour() -> u64 {
    3600
}

async fn issue_token(
    State(st): State<AppState>,
    h: HeaderMap,
    Path(t): Path<String>,
    b: Body,
) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "tenant.manage", "tenant", &[&t])?;
    let req: TokenRequest = body(b).await?;
    if req.audience != CONTROLPLANE_AUDIENCE && req.audience != felix_wire::token::BROKER_AUDIENCE {
        return Err(ApiError::invalid(
            "audience",
            "felix-broker or felix-controlplane",
        ));
    }
    if req.ttl_seconds == 0 || req.ttl_seconds > 365 * 24 * 3600 {
        return Err(ApiError::invalid("ttl_seconds", "1 second to 1 year"));
    }
    for p in &req.perms {
        let mut parts = p.splitn(3, ':');
        let (Some(action), Some(_kind), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(ApiError::invalid(
                "perms",
                format!("{p:?} is not action:kind:path"),
            ));
        };
        let inside = !operator_only(p) && path.split('/').next() == Some(t.as_str());
        // The operator tenant hands out cluster and node permissions it holds itself.
        let operator_scope =
            operator_only(p) && t == OPERATOR_TENANT && g.allows_object(action, "cluster", &["*"]);
        if !(inside || operator_scope) {
            return Err(ApiError::forbidden(format!(
                "{p:?} reaches outside tenant {t}"
            )));
        }
    }
    // A tenant's token mints none that outlives it: denying it (or letting it lapse)
    // would otherwise leave every token it minted meanwhile running for up to a year.
    // The operator's are exempt: every token descends from the bootstrap token, and
    // the cluster's tokens must outlive it (a year) by operators minting new ones.
    let now = now_ms() / 1000;
    let mut exp = now + req.ttl_seconds;
    if !g.allows_object("tenant.manage", "cluster", &["*"]) {
        if g.expires_at <= now {
            // In the minute of skew a token is accepted past its expiry: a token minted
            // now would outlive it, and could mint the next.
            // 403, not 401: a token that verifies but may not do this (and so the try is
            // in the audit log, which records no 401).
            return Err(ApiError::forbidden(
                "this token has expired: it mints no tokens",
            ));
        }
        exp = exp.min(g.expires_at);
    }
    let key = active_key(&st, &t).await?;
    let (token, jti) = sign(&key, &t, &req.sub, &req.audience, req.perms, (now, exp));
    Ok(Json(
        json!({"token": token, "jti": jti, "kid": key.kid, "expires_in": exp - now}),
    ))
}

async fn list_namespaces(
    State(st): State<AppState>,
    h: HeaderMap,
    Path(t): Path<String>,
) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "ns.manage", "namespace", &[&t, "*"])?;
    let items: Vec<Namespace> = st
        .store
        .list(Kind::Namespace, &format!("{t}/"))
        .await?
        .iter()
        .map(to)
        .collect::<ApiResult<_>>()?;
    Ok(Json(json!({"items": items})))
}

async fn create_namespace(
    State(st): State<AppState>,
    h: HeaderMap,
    Path(t): Path<String>,
    b: Body,
) -> ApiResult<(StatusCode, Json<Namespace>)> {
    let g = authenticate(&st, &h).await?;
    let mut ns: Namespace = body::<NamespaceCreate>(b).await?.into();
    name("namespace", &ns.namespace)?;
    display_name(&ns.display_name)?;
    require(&g, "ns.manage", "namespace", &[&t, &ns.namespace])?;
    ns.tenant_id = t.clone();
    let tenant = must_exist(&st, Kind::Tenant, &t).await?;
    st.store
        .batch(vec![
            Op::Put {
                kind: Kind::Tenant,
                key: t.clone(),
                value: tenant.value,
                expect: Expect::Version(tenant.version),
            },
            Op::Put {
                kind: Kind::Namespace,
                key: format!("{t}/{}", ns.namespace),
                value: val(&ns),
                expect: Expect::Absent,
            },
        ])
        .await?;
    Ok((StatusCode::CREATED, Json(ns)))
}

async fn delete_namespace(
    State(st): State<AppState>,
    h: HeaderMap,
    Path((t, ns)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    let g = authenticate(&st, &h).await?;
    require(&g, "ns.manage", "namespace", &[&t, &ns])?;
    // Creating a stream or cache rewrites its namespace, so deleting at the version
    // read here fails if one was created after the emptiness check.
    let d = namespace_must_exist(&st, &t, &ns).await?;
    let prefix = format!("{t}/{ns}/");
    if !st.store.list(Kind::Stream, &prefix).await?.is_empty()
        || !st.store.list(Kind::Cache, &prefix).await?.is_empty()
    {
        return Err(ApiError::conflict(format!(
            "namespace {t}/{ns} still has streams or caches"
        )));
    }
    st.store
        .batch(vec![Op::Delete {
            kind: Kind::Namespace,
            key: d.key,
            expect: Expect::Version(d.version),
        }])
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn namespace_must_exist(st: &AppState, t: &str, ns: &str) -> ApiResult<Doc> {
    must_exist(st, Kind::Namespace, &format!("{t}/{ns}")).await
}

/// The document at `key`, or 404 "<kind> <key> not found".
async fn must_exist(st: &AppState, kind: Kind, key: &str) -> ApiResult<Doc> {
    st.store
        .get(kind, key)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("{} {key} not found", kind.name())))
}

fn with_version<T: DeserializeOwned>(d: &Doc) -> ApiResult<(T, u64)> {
    Ok((to(d)?, d.version))
}

async fn list_streams(
    State(st): State<AppState>,
    h: HeaderMap,
    Path((t, ns)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "stream.manage", "stream", &[&t, &ns, "*"])?;
    let mut items = Vec::new();
    for d in st.store.list(Kind::Stream, &format!("{t}/{ns}/")).await? {
        let (mut s, v): (Stream, u64) = with_version(&d)?;
        s.version = v;
        items.push(s);
    }
    Ok(Json(json!({"items": items})))
}

async fn streams_snapshot(State(st): State<AppState>, h: HeaderMap) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "node.view", "cluster", &["*"])?;
    let mut streams = Vec::new();
    for d in st.store.list(Kind::Stream, "").await? {
        let (mut s, v): (Stream, u64) = with_version(&d)?;
        s.version = v;
        streams.push(s);
    }
    let mut caches = Vec::new();
    for d in st.store.list(Kind::Cache, "").await? {
        let (mut c, v): (Cache, u64) = with_version(&d)?;
        c.version = v;
        caches.push(c);
    }
    Ok(Json(json!({"items": streams, "caches": caches})))
}

async fn create_stream(
    State(st): State<AppState>,
    h: HeaderMap,
    Path((t, ns)): Path<(String, String)>,
    b: Body,
) -> ApiResult<(StatusCode, Json<Stream>)> {
    let g = authenticate(&st, &h).await?;
    let spec: StreamCreate = body(b).await?;
    name("stream", &spec.stream)?;
    require(&g, "stream.manage", "stream", &[&t, &ns, &spec.stream])?;
    if spec.shards == 0 || spec.shards > 4096 {
        return Err(ApiError::invalid("shards", "1 to 4096"));
    }
    if spec.replication_factor == 0 || spec.replication_factor > 7 {
        return Err(ApiError::invalid("replication_factor", "1 to 7"));
    }
    if spec.retention.max_age_seconds == Some(0) {
        return Err(ApiError::invalid(
            "retention.max_age_seconds",
            "0 is not a bound; omit it",
        ));
    }
    if spec.retention.max_size_bytes == Some(0) {
        return Err(ApiError::invalid(
            "retention.max_size_bytes",
            "0 is not a bound; omit it",
        ));
    }
    if !matches!(spec.kind.as_str(), "Stream" | "Queue" | "Cache") {
        return Err(ApiError::invalid("kind", "Stream, Queue or Cache"));
    }
    if !matches!(spec.delivery.as_str(), "AtMostOnce" | "AtLeastOnce") {
        return Err(ApiError::invalid("delivery", "AtMostOnce or AtLeastOnce"));
    }
    let stream = Stream {
        tenant_id: t.clone(),
        namespace: ns.clone(),
        spec,
        version: 0,
        incarnation: random_hex(8),
    };
    let name = stream.spec.stream.clone();
    let shards = (Kind::Stream, name.as_str(), stream.spec.shards);
    let version = create_in_namespace(&st, &t, &ns, shards, val(&stream)).await?;
    Ok((StatusCode::CREATED, Json(Stream { version, ..stream })))
}

/// Creates a stream or cache document of `shards` shards, rewriting its namespace at the
/// version read so that a namespace deleted meanwhile makes the create fail (and vice
/// versa), and refusing it (409) past the tenant's or the cluster's shard bound
/// ([`limits`]). A batch that raced another create counts again. Returns the new
/// document's version.
async fn create_in_namespace(
    st: &AppState,
    t: &str,
    ns: &str,
    (kind, name, shards): (Kind, &str, u32),
    value: Value,
) -> ApiResult<u64> {
    let key = format!("{t}/{ns}/{name}");
    let mut raced = 0;
    loop {
        let fence = limits::fence(st.store.as_ref(), &st.counted).await?;
        let ns_doc = namespace_must_exist(st, t, ns).await?;
        if st.store.get(kind, &key).await?.is_some() {
            return Err(ApiError::conflict(format!(
                "{} {key} already exists",
                kind.name()
            )));
        }
        let held = limits::shards_held(st.store.as_ref(), &format!("{t}/")).await?;
        limits::room_for_shards(t, held, fence.totals.shards, shards)
            .map_err(|e| ApiError::conflict(e.0))?;
        let totals = limits::Totals {
            shards: fence.totals.shards + u64::from(shards),
            ..fence.totals
        };
        let written = st
            .store
            .batch(vec![
                fence.write(totals),
                Op::Put {
                    kind: Kind::Namespace,
                    key: ns_doc.key,
                    value: ns_doc.value,
                    expect: Expect::Version(ns_doc.version),
                },
                Op::Put {
                    kind,
                    key: key.clone(),
                    value: value.clone(),
                    expect: Expect::Absent,
                },
            ])
            .await;
        match written {
            Ok(written) => return Ok(written[2].version),
            // The name taken meanwhile is told as such at the next pass.
            Err(StoreError::Conflict { .. }) if st.store.get(kind, &key).await?.is_some() => {}
            Err(e) => raced_again(e, &mut raced, fence).await?,
        }
    }
}

/// Whether a counted write whose batch failed with `e` should count and write again:
/// a conflict (another write moved what it read) up to [`RACED_WRITES_MAX`] times,
/// after a random pause under a ceiling that doubles each time (every counted write of
/// the cluster rewrites one fence: tried again at once, writers that collided collide
/// again, and of 32 creates at once most were refused), then 409; anything else is the
/// answer. The `fence` read is dropped first: the pause is outside this control
/// plane's turn of counted writes.
async fn raced_again(e: StoreError, raced: &mut u32, fence: limits::Fence) -> ApiResult<()> {
    drop(fence);
    match e {
        StoreError::Conflict { .. } if *raced < RACED_WRITES_MAX => {
            tokio::time::sleep(raced_pause(*raced, random_unit())).await;
            *raced += 1;
            Ok(())
        }
        StoreError::Conflict { .. } => Err(ApiError::conflict(
            "other writes at once moved what this one counted, each time it tried: retry",
        )),
        e => Err(e.into()),
    }
}

/// Deletes a stream or cache and, in the same batch, its shard assignments.
async fn delete_with_assignments(
    st: &AppState,
    kind: Kind,
    t: &str,
    ns: &str,
    name: &str,
) -> ApiResult<()> {
    let key = format!("{t}/{ns}/{name}");
    let mut raced = 0;
    loop {
        // Its shards leave the cluster's total in the same batch.
        let fence = limits::fence(st.store.as_ref(), &st.counted).await?;
        let d = must_exist(st, kind, &key).await?;
        let totals = limits::Totals {
            shards: fence
                .totals
                .shards
                .saturating_sub(limits::shards_of(&d.value)),
            ..fence.totals
        };
        let mut ops = vec![
            fence.write(totals),
            Op::Delete {
                kind,
                key: key.clone(),
                expect: Expect::Version(d.version),
            },
        ];
        for a in st
            .store
            .list(
                Kind::Assignment,
                &format!("{}/{t}/{ns}/{name}/", kind.name()),
            )
            .await?
        {
            ops.push(Op::Delete {
                kind: Kind::Assignment,
                key: a.key,
                expect: Expect::Any,
            });
        }
        match st.store.batch(ops).await {
            Ok(_) => return Ok(()),
            Err(e) => raced_again(e, &mut raced, fence).await?,
        }
    }
}

async fn get_stream(
    State(st): State<AppState>,
    h: HeaderMap,
    Path((t, ns, s)): Path<(String, String, String)>,
) -> ApiResult<Json<Stream>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "stream.manage", "stream", &[&t, &ns, &s])?;
    let d = must_exist(&st, Kind::Stream, &format!("{t}/{ns}/{s}")).await?;
    let (mut stream, v): (Stream, u64) = with_version(&d)?;
    stream.version = v;
    Ok(Json(stream))
}

async fn patch_stream(
    State(st): State<AppState>,
    h: HeaderMap,
    Path((t, ns, s)): Path<(String, String, String)>,
    b: Body,
) -> ApiResult<Json<Stream>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "stream.manage", "stream", &[&t, &ns, &s])?;
    let patch: StreamPatch = body(b).await?;
    let key = format!("{t}/{ns}/{s}");
    let d = must_exist(&st, Kind::Stream, &key).await?;
    if let Some(v) = patch.version
        && v != d.version
    {
        return Err(ApiError::conflict(format!(
            "stream is at version {}, not {v}",
            d.version
        )));
    }
    let mut stream: Stream = to(&d)?;
    if let Some(r) = patch.retention {
        if r.max_age_seconds == Some(0) || r.max_size_bytes == Some(0) {
            return Err(ApiError::invalid("retention", "0 is not a bound; omit it"));
        }
        stream.spec.retention = r;
    }
    if let Some(c) = patch.consistency {
        stream.spec.consistency = c;
    }
    if let Some(d) = patch.delivery {
        if !matches!(d.as_str(), "AtMostOnce" | "AtLeastOnce") {
            return Err(ApiError::invalid("delivery", "AtMostOnce or AtLeastOnce"));
        }
        stream.spec.delivery = d;
    }
    if patch.durable.is_some_and(|d| d != stream.spec.durable) {
        // Immutable while the stream exists (as the reference has it): flipped to
        // false, a one-copy stream whose broker went down was reopened empty elsewhere,
        // a tenant's PATCH doing what only the operator's abandon may.
        return Err(ApiError::invalid(
            "durable",
            "a stream's durability is set when it is created",
        ));
    }
    let written = st
        .store
        .batch(vec![Op::Put {
            kind: Kind::Stream,
            key,
            value: val(&stream),
            expect: Expect::Version(d.version),
        }])
        .await?;
    stream.version = written[0].version;
    Ok(Json(stream))
}

async fn delete_stream(
    State(st): State<AppState>,
    h: HeaderMap,
    Path((t, ns, s)): Path<(String, String, String)>,
) -> ApiResult<StatusCode> {
    let g = authenticate(&st, &h).await?;
    require(&g, "stream.manage", "stream", &[&t, &ns, &s])?;
    delete_with_assignments(&st, Kind::Stream, &t, &ns, &s).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn list_caches(
    State(st): State<AppState>,
    h: HeaderMap,
    Path((t, ns)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "cache.manage", "cache", &[&t, &ns, "*"])?;
    let mut items = Vec::new();
    for d in st.store.list(Kind::Cache, &format!("{t}/{ns}/")).await? {
        let (mut c, v): (Cache, u64) = with_version(&d)?;
        c.version = v;
        items.push(c);
    }
    Ok(Json(json!({"items": items})))
}

async fn create_cache(
    State(st): State<AppState>,
    h: HeaderMap,
    Path((t, ns)): Path<(String, String)>,
    b: Body,
) -> ApiResult<(StatusCode, Json<Cache>)> {
    let g = authenticate(&st, &h).await?;
    let spec: CacheCreate = body(b).await?;
    name("cache", &spec.cache)?;
    display_name(&spec.display_name)?;
    require(&g, "cache.manage", "cache", &[&t, &ns, &spec.cache])?;
    if spec.shards == 0 || spec.shards > 4096 {
        return Err(ApiError::invalid("shards", "1 to 4096"));
    }
    if spec.replication_factor == 0 || spec.replication_factor > 7 {
        return Err(ApiError::invalid("replication_factor", "1 to 7"));
    }
    let cache = Cache {
        tenant_id: t.clone(),
        namespace: ns.clone(),
        spec,
        version: 0,
        incarnation: random_hex(8),
    };
    let name = cache.spec.cache.clone();
    let shards = (Kind::Cache, name.as_str(), cache.spec.shards);
    let version = create_in_namespace(&st, &t, &ns, shards, val(&cache)).await?;
    Ok((StatusCode::CREATED, Json(Cache { version, ..cache })))
}

async fn get_cache(
    State(st): State<AppState>,
    h: HeaderMap,
    Path((t, ns, c)): Path<(String, String, String)>,
) -> ApiResult<Json<Cache>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "cache.manage", "cache", &[&t, &ns, &c])?;
    let d = must_exist(&st, Kind::Cache, &format!("{t}/{ns}/{c}")).await?;
    let (mut cache, v): (Cache, u64) = with_version(&d)?;
    cache.version = v;
    Ok(Json(cache))
}

async fn delete_cache(
    State(st): State<AppState>,
    h: HeaderMap,
    Path((t, ns, c)): Path<(String, String, String)>,
) -> ApiResult<StatusCode> {
    let g = authenticate(&st, &h).await?;
    require(&g, "cache.manage", "cache", &[&t, &ns, &c])?;
    delete_with_assignments(&st, Kind::Cache, &t, &ns, &c).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn list_nodes(State(st): State<AppState>, h: HeaderMap) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "node.view", "cluster", &["*"])?;
    let items: Vec<Node> = st
        .store
        .list(Kind::Node, "")
        .await?
        .iter()
        .map(to)
        .collect::<ApiResult<_>>()?;
    Ok(Json(json!({"items": items})))
}

async fn register_node(
    State(st): State<AppState>,
    h: HeaderMap,
    b: Body,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let g = authenticate(&st, &h).await?;
    let reg: NodeRegistration = body(b).await?;
    name("node_id", &reg.node_id)?;
    require(&g, "node.manage", "node", &[&reg.node_id])?;
    for (field, addr) in [
        ("client_addr", &reg.client_addr),
        ("advertise_addr", &reg.advertise_addr),
    ] {
        if let Some(a) = addr
            && a.parse::<std::net::SocketAddr>().is_err()
        {
            return Err(ApiError::invalid(field, format!("{a:?} is not host:port")));
        }
    }
    let existing = st.store.get(Kind::Node, &reg.node_id).await?;
    let previous = existing.as_ref().map(to::<Node>).transpose()?;
    if let Some(old) = &previous {
        in_use_by_another(old, &reg, liveness_ms(), st.config.down_after())?;
    }
    let incarnation = previous.map_or(1, |n| n.incarnation + 1);
    let node = Node {
        registration: reg,
        lifecycle: Lifecycle::Live,
        incarnation,
        last_heartbeat_ms: liveness_ms(),
    };
    st.store
        .batch(vec![Op::Put {
            kind: Kind::Node,
            key: node.registration.node_id.clone(),
            value: val(&node),
            expect: existing.map_or(Expect::Absent, |d| Expect::Version(d.version)),
        }])
        .await?;
    let mut answer = val(&node);
    add_timing(&mut answer, &st.config);
    Ok((StatusCode::OK, Json(answer)))
}

/// Refuses a registration of `old`'s id by a different broker process while `old`
/// may still hold its lease (live or draining, heard from within `down_after`): two
/// brokers under one id would both believe they lead that node's shards. The same
/// process registering again (a restart over the same data directory) is a new
/// incarnation as before; so is anyone once the old one has been silent long enough to
/// be declared down. A node registered without an instance id is not checked; a
/// registration without one over a node that has one is another process (it skipped
/// the check: anyone holding the node's token moved a live node's addresses).
fn in_use_by_another(
    old: &Node,
    reg: &NodeRegistration,
    now_ms: u64,
    down_after: Duration,
) -> ApiResult<()> {
    let Some(theirs) = &old.registration.instance_id else {
        return Ok(());
    };
    let silent_ms = now_ms.saturating_sub(old.last_heartbeat_ms);
    if reg.instance_id.as_ref() == Some(theirs)
        || !matches!(old.lifecycle, Lifecycle::Live | Lifecycle::Draining)
        || silent_ms >= down_after.as_millis() as u64
    {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::CONFLICT,
        "node_id_in_use",
        format!(
            "node id {} is held by another broker (instance {theirs}, heard from {silent_ms} ms ago); \
             give this one its own node id, or stop the other and retry after {} ms",
            reg.node_id,
            down_after.as_millis() as u64 - silent_ms
        ),
    ))
}

async fn get_node(
    State(st): State<AppState>,
    h: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<Json<Node>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "node.view", "cluster", &["*"])?;
    let d = must_exist(&st, Kind::Node, &id).await?;
    Ok(Json(to(&d)?))
}

async fn delete_node(
    State(st): State<AppState>,
    h: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let g = authenticate(&st, &h).await?;
    require(&g, "node.manage", "cluster", &["*"])?;
    let d = must_exist(&st, Kind::Node, &id).await?;
    let node: Node = to(&d)?;
    if matches!(node.lifecycle, Lifecycle::Live | Lifecycle::Draining) {
        return Err(ApiError::conflict(format!(
            "node {id} is {:?}",
            node.lifecycle
        )));
    }
    for a in st.store.list(Kind::Assignment, "").await? {
        let a: Assignment = to(&a)?;
        if a.leader == id {
            return Err(ApiError::conflict(format!(
                "node {id} still leads {}",
                a.key.store_key()
            )));
        }
    }
    st.store
        .batch(vec![Op::Delete {
            kind: Kind::Node,
            key: id,
            expect: Expect::Version(d.version),
        }])
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Heartbeat {
    incarnation: u64,
}

async fn heartbeat(
    State(st): State<AppState>,
    h: HeaderMap,
    Path(id): Path<String>,
    b: Body,
) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "node.manage", "node", &[&id])?;
    let hb: Heartbeat = body(b).await?;
    // A write racing this one (a drain, a pass marking the node down) moves the node's
    // version: read it again and judge again. Answered 409, a broker takes it as
    // declared down and registers again, as live: a drain racing its heartbeat was
    // undone that way, and the drained node given new shards.
    let mut raced = 0;
    let node = loop {
        let d = st
            .store
            .get(Kind::Node, &id)
            .await?
            .ok_or_else(|| ApiError::not_found(format!("node {id} not registered")))?;
        let mut node: Node = to(&d)?;
        if hb.incarnation < node.incarnation {
            return Err(ApiError::conflict(format!(
                "incarnation {} is older than {}",
                hb.incarnation, node.incarnation
            )));
        }
        if node.lifecycle == Lifecycle::Down || node.lifecycle == Lifecycle::Left {
            return Err(ApiError::conflict(format!(
                "node {id} is {:?}: register again",
                node.lifecycle
            )));
        }
        node.last_heartbeat_ms = liveness_ms();
        let written = st
            .store
            .batch(vec![Op::Put {
                kind: Kind::Node,
                key: id.clone(),
                value: val(&node),
                expect: Expect::Version(d.version),
            }])
            .await;
        match written {
            Ok(_) => break node,
            Err(StoreError::Conflict { .. }) if raced < RACED_WRITES_MAX => raced += 1,
            Err(e) => return Err(e.into()),
        }
    };
    let mut answer = json!({"node_id": id, "lifecycle": node.lifecycle});
    add_timing(&mut answer, &st.config);
    Ok(Json(answer))
}

/// How many times a handler reads a document again after a concurrent write moved its
/// version under it, before it answers 409.
const RACED_WRITES_MAX: u32 = 8;

/// The first ceiling of the pause before a counted write tries again, and its cap: the
/// eight pauses together come to 955 ms at most.
const RACED_PAUSE_FIRST: Duration = Duration::from_millis(5);
const RACED_PAUSE_MAX: Duration = Duration::from_millis(320);

/// The pause before try `raced + 1` of a counted write: `unit` (in `[0, 1)`) of
/// `RACED_PAUSE_FIRST * 2^raced`, capped at `RACED_PAUSE_MAX`.
fn raced_pause(raced: u32, unit: f64) -> Duration {
    let ceiling = RACED_PAUSE_FIRST
        .saturating_mul(1 << raced.min(16))
        .min(RACED_PAUSE_MAX);
    ceiling.mul_f64(unit.clamp(0.0, 1.0))
}

/// A random number in `[0, 1)`, from the system random source [`random_hex`] uses.
fn random_unit() -> f64 {
    use ring::rand::SecureRandom as _;
    let mut b = [0u8; 8];
    ring::rand::SystemRandom::new()
        .fill(&mut b)
        .expect("the system random source");
    (u64::from_le_bytes(b) >> 11) as f64 / (1u64 << 53) as f64
}

/// The timing a broker's lease follows: it heartbeats every `heartbeat_interval_ms`,
/// keeps its lease for `expiry_timeout_ms - expiry_timeout_ms/4` from each heartbeat it
/// sent, and is marked down only after `expiry_timeout_ms + regrant_margin_ms` of
/// silence.
fn add_timing(answer: &mut Value, config: &ApiConfig) {
    let ms = |d: Duration| json!(d.as_millis() as u64);
    answer["heartbeat_interval_ms"] = ms(config.heartbeat_interval);
    answer["expiry_timeout_ms"] = ms(config.expiry_timeout);
    answer["regrant_margin_ms"] = ms(config.regrant_margin());
}

async fn list_assignments(State(st): State<AppState>, h: HeaderMap) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "node.view", "cluster", &["*"])?;
    let items = assignments_with_replication(&st).await?;
    Ok(Json(json!({"items": items})))
}

/// Every assignment, each with `under_replicated` and the `positions` of the latest
/// replica report (`{}` when none is known). Derived, so not in the change feed.
async fn assignments_with_replication(st: &AppState) -> ApiResult<Vec<Value>> {
    let now = liveness_ms();
    let ready = ready_ids(st, now).await?;
    let reports = st
        .reports
        .snapshot(now, st.config.report_ttl().as_millis() as u64);
    let mut items = Vec::new();
    for d in st.store.list(Kind::Assignment, "").await? {
        let a: Assignment = to(&d)?;
        items.push(snapshot_item(
            &a,
            |n| ready.contains(n),
            reports.get(&d.key),
        ));
    }
    Ok(items)
}

/// One assignment as the snapshot and the feed serve it: with whether it is
/// under-replicated and its replicas' reported positions.
fn snapshot_item(
    a: &Assignment,
    ready: impl Fn(&str) -> bool,
    report: Option<&StoredReport>,
) -> Value {
    let mut v = val(a);
    v["under_replicated"] = json!(crate::replication::under_replicated(a, ready, report));
    v["positions"] = json!(report.map(StoredReport::positions).unwrap_or_default());
    v
}

/// Ids of the nodes that are ready at `now`.
async fn ready_ids(st: &AppState, now: u64) -> ApiResult<std::collections::HashSet<String>> {
    let mut out = std::collections::HashSet::new();
    for d in st.store.list(Kind::Node, "").await? {
        let n: Node = to(&d)?;
        if placement::standing(&n, &st.config, now, 0).ready {
            out.insert(n.registration.node_id);
        }
    }
    Ok(out)
}

async fn assignments_snapshot(State(st): State<AppState>, h: HeaderMap) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "node.view", "cluster", &["*"])?;
    // The head is read first: changes after it are served by /changes, so a write
    // racing the snapshot is seen twice (harmless) rather than never.
    let head = st.store.head().await?;
    let items = assignments_with_replication(&st).await?;
    Ok(Json(json!({"items": items, "next_seq": head})))
}

#[derive(Deserialize)]
struct ChangesQuery {
    since: u64,
    #[serde(default)]
    wait_ms: u64,
}

async fn assignment_changes(
    State(st): State<AppState>,
    h: HeaderMap,
    Query(q): Query<ChangesQuery>,
) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "node.view", "cluster", &["*"])?;
    let wait = Duration::from_millis(q.wait_ms.min(25_000));
    let (items, next) = st
        .store
        .changes(Kind::Assignment, q.since, 1000, wait)
        .await?;
    // Read after the page: a cut between the two can only ask for a resync the page
    // did not need, never hide one it did.
    let resync = q.since < st.store.trimmed().await?;
    Ok(Json(
        json!({"items": items, "next_seq": next, "resync": resync}),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MoveRequest {
    tenant_id: String,
    namespace: String,
    stream: String,
    shard: u32,
    #[serde(default = "stream_kind")]
    kind: String,
    destination: String,
}

fn stream_kind() -> String {
    "stream".into()
}

async fn shard_move(State(st): State<AppState>, h: HeaderMap, b: Body) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "node.manage", "cluster", &["*"])?;
    let m: MoveRequest = body(b).await?;
    let key = AssignmentKey {
        tenant_id: m.tenant_id,
        namespace: m.namespace,
        kind: m.kind,
        name: m.stream,
        shard: m.shard,
    };
    let d = st
        .store
        .get(Kind::Assignment, &key.store_key())
        .await?
        .ok_or_else(|| ApiError::not_found(format!("unknown_shard: {}", key.store_key())))?;
    let mut a: Assignment = to(&d)?;
    let nodes = ready_nodes(st.store.as_ref(), &st.config).await?;
    if !nodes
        .iter()
        .any(|n| n.registration.node_id == m.destination)
    {
        return Err(ApiError::conflict(format!(
            "destination_not_live: {}",
            m.destination
        )));
    }
    if a.leader == m.destination {
        return Err(ApiError::conflict("already_leader"));
    }
    if a.staging.is_some() || a.retiring.is_some() {
        return Err(ApiError::conflict(format!(
            "already_moving: {} has a copy being staged or a member retiring (a move or \
             a restore under way)",
            key.store_key()
        )));
    }
    let staged = !a.replicas.contains(&m.destination);
    if staged {
        // A broker outside the set holds nothing yet: a copy is staged there first
        // (shipped by the leader, counted by no majority) and placement cuts over once
        // it holds the log. A shard with one copy has nothing shipping its log.
        if a.replicas.len() < 2 {
            return Err(ApiError::conflict(format!(
                "destination_not_replica: {} holds no copy of {}, and a shard with one \
                 copy cannot stage one (nothing ships its log); move it within a \
                 replicated stream or cache",
                m.destination,
                key.store_key()
            )));
        }
        // At the same generation: no member changes, so no election.
        a.staging = Some(m.destination.clone());
        a.replaces = Some(a.leader.clone());
    } else {
        let from = std::mem::replace(&mut a.leader, m.destination.clone());
        a.generation += 1;
        a.handoff = Some(Handoff {
            from,
            generation: a.generation,
        });
    }
    st.store
        .batch(vec![Op::Put {
            kind: Kind::Assignment,
            key: key.store_key(),
            value: val(&a),
            expect: Expect::Version(d.version),
        }])
        .await?;
    Ok(Json(json!({"assignment": a, "staged": staged})))
}

/// `POST /v1/nodes/{id}/drain`: the node stops taking new roles (lifecycle
/// `draining`) and every shard it leads that has another ready replica is handed to one
/// (a new generation, as a move). The new leader fences a majority and takes the
/// furthest-ahead log before it serves, so the choice among replicas is safe; a lagging
/// one only takes longer. Answers the shards moved and those kept (no other ready
/// replica: an unreplicated shard stays until its node comes back).
async fn drain_node(
    State(st): State<AppState>,
    h: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "node.manage", "node", &[&id])?;
    // The node's own heartbeats write its document every interval: read again when one
    // lands between this read and this write (answered 409, a broker's own drain at
    // SIGTERM gave up and stopped without handing its shards over).
    let mut raced = 0;
    loop {
        let d = must_exist(&st, Kind::Node, &id).await?;
        let mut node: Node = to(&d)?;
        match node.lifecycle {
            Lifecycle::Live => {
                node.lifecycle = Lifecycle::Draining;
                let written = st
                    .store
                    .batch(vec![Op::Put {
                        kind: Kind::Node,
                        key: id.clone(),
                        value: val(&node),
                        expect: Expect::Version(d.version),
                    }])
                    .await;
                match written {
                    Ok(_) => break,
                    Err(StoreError::Conflict { .. }) if raced < RACED_WRITES_MAX => raced += 1,
                    Err(e) => return Err(e.into()),
                }
            }
            Lifecycle::Draining => break,
            other => {
                return Err(ApiError::conflict(format!("node {id} is {other:?}")));
            }
        }
    }
    let ready: Vec<String> = ready_nodes(st.store.as_ref(), &st.config)
        .await?
        .into_iter()
        .map(|n| n.registration.node_id)
        .collect();
    let reports = st
        .reports
        .snapshot(liveness_ms(), st.config.report_ttl().as_millis() as u64);
    let (mut moved, mut kept) = (Vec::new(), Vec::new());
    for doc in st.store.list(Kind::Assignment, "").await? {
        // A placement pass may write the same assignment meanwhile: read it again and
        // decide again, rather than fail the drain with some shards moved and the
        // answer lost.
        let mut doc = doc;
        let mut raced = 0;
        loop {
            let mut a: Assignment = to(&doc)?;
            if a.leader != id {
                break;
            }
            let key = a.key.store_key();
            // A member that is not on its way out first; a move or restore under way is
            // abandoned (its copy was to replace this leader, or is shipped to by it).
            // Never one its leader reports halted (its log disagrees below the commit
            // mark: as candidate it could never take the log) or rebuilding its copy
            // (its election would count it for nothing): the shard stays then.
            let report = reports.get(&key);
            let unfit = |r: &str| report.is_some_and(|p| p.halted(r) || p.rebuilding(r));
            let candidates = || {
                a.replicas
                    .iter()
                    .filter(|r| **r != id && ready.contains(r) && !unfit(r))
            };
            let Some(to_node) = candidates()
                .find(|r| Some(*r) != a.retiring.as_ref())
                .or_else(|| candidates().next())
                .cloned()
            else {
                kept.push(key);
                break;
            };
            (a.staging, a.replaces) = (None, None);
            if a.retiring.as_ref() == Some(&to_node) {
                a.retiring = None;
            }
            a.leader = to_node.clone();
            a.generation += 1;
            a.handoff = Some(Handoff {
                from: id.clone(),
                generation: a.generation,
            });
            let written = st
                .store
                .batch(vec![Op::Put {
                    kind: Kind::Assignment,
                    key: key.clone(),
                    value: val(&a),
                    expect: Expect::Version(doc.version),
                }])
                .await;
            match written {
                Ok(_) => {
                    moved
                        .push(json!({"shard": key, "leader": to_node, "generation": a.generation}));
                    break;
                }
                Err(StoreError::Conflict { .. }) if raced < RACED_WRITES_MAX => {
                    raced += 1;
                    match st.store.get(Kind::Assignment, &key).await? {
                        Some(d) => doc = d,
                        None => break,
                    }
                }
                // Its stream was deleted since the list: nothing left to hand over.
                Err(StoreError::NotFound { .. }) => break,
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(Json(json!({"node_id": id, "moved": moved, "kept": kept})))
}

/// Nodes that may be assigned shards: live, heard from within the expiry, and with a
/// client address.
pub async fn ready_nodes(store: &dyn Store, config: &ApiConfig) -> Result<Vec<Node>, StoreError> {
    let now = liveness_ms();
    let mut out = Vec::new();
    for d in store.list(Kind::Node, "").await? {
        let Ok(n) = serde_json::from_value::<Node>(d.value.clone()) else {
            continue;
        };
        if placement::standing(&n, config, now, 0).ready {
            out.push(n);
        }
    }
    Ok(out)
}

async fn replica_status(
    State(st): State<AppState>,
    h: HeaderMap,
    Path(id): Path<String>,
    b: Body,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let g = authenticate(&st, &h).await?;
    require(&g, "node.manage", "node", &[&id])?;
    let req: ReplicaStatus = body(b).await?;
    for r in &req.shards {
        if !matches!(r.kind.as_str(), "stream" | "cache") {
            return Err(ApiError::invalid("shards.kind", "stream or cache"));
        }
        if r.commit > r.log_end {
            return Err(ApiError::invalid(
                "shards.commit",
                format!("commit {} is past log_end {}", r.commit, r.log_end),
            ));
        }
    }
    let now = liveness_ms();
    let ttl = st.config.report_ttl().as_millis() as u64;
    let mut results = Vec::new();
    let mut refused = 0;
    for r in req.shards {
        let key = r.key();
        let a: Option<Assignment> = st
            .store
            .get(Kind::Assignment, &key.store_key())
            .await?
            .as_ref()
            .map(to)
            .transpose()?;
        let generation = r.generation;
        let verdict = st.reports.offer(&id, r, a.as_ref(), now, ttl);
        if verdict != Verdict::Accepted {
            refused += 1;
        }
        let mut v = val(&key);
        v["generation"] = json!(generation);
        v["result"] = json!(verdict);
        results.push(v);
    }
    if refused == 0 {
        return Ok((StatusCode::OK, Json(json!({"results": results}))));
    }
    let message = format!("{refused} of {} shard reports refused", results.len());
    Ok((
        StatusCode::CONFLICT,
        Json(json!({"code": "conflict", "message": message, "results": results})),
    ))
}

async fn replication_view(State(st): State<AppState>, h: HeaderMap) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "node.view", "cluster", &["*"])?;
    let now = liveness_ms();
    let ready = ready_ids(&st, now).await?;
    let reports = st
        .reports
        .snapshot(now, st.config.report_ttl().as_millis() as u64);
    let mut items = Vec::new();
    for d in st.store.list(Kind::Assignment, "").await? {
        let a: Assignment = to(&d)?;
        if a.replicas.len() < 2 {
            continue;
        }
        items.push(view_item(
            &a,
            |n| ready.contains(n),
            reports.get(&d.key),
            now,
        ));
    }
    Ok(Json(json!({"items": items})))
}

/// One replicated shard as the replication view serves it, at `now` (ms).
fn view_item(
    a: &Assignment,
    ready: impl Fn(&str) -> bool,
    report: Option<&StoredReport>,
    now: u64,
) -> Value {
    let positions = report.map(StoredReport::positions).unwrap_or_default();
    let members: Vec<Value> = a
        .replicas
        .iter()
        .map(|n| {
            json!({
                "node_id": n,
                "leader": *n == a.leader,
                "ready": ready(n),
                "position": positions.get(n),
                "halted": report.is_some_and(|r| r.halted(n)),
                "rebuilding": report.is_some_and(|r| r.rebuilding(n)),
            })
        })
        .collect();
    let mut v = val(&a.key);
    v["leader"] = json!(a.leader);
    v["generation"] = json!(a.generation);
    v["members"] = json!(members);
    v["under_replicated"] = json!(crate::replication::under_replicated(a, &ready, report));
    v["report"] = report.map_or(Value::Null, |r| {
        json!({
            "from": r.from,
            "generation": r.report.generation,
            "log_end": r.report.log_end,
            "commit": r.report.commit,
            "generation_committed": r.report.generation_committed,
            "cannot_lead": r.report.cannot_lead,
            "age_ms": now.saturating_sub(r.received_ms),
        })
    });
    v
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AbandonRequest {
    kind: String,
    tenant_id: String,
    namespace: String,
    name: String,
    shard: u32,
}

/// Places a shard nobody holding its data can take on the best ready node, with an
/// empty log: whatever only the old leader (or the old set) held is lost. For an
/// unreplicated durable shard whose owner will not come back; placement never does
/// this on its own.
async fn abandon(State(st): State<AppState>, h: HeaderMap, b: Body) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "node.manage", "cluster", &["*"])?;
    let req: AbandonRequest = body(b).await?;
    if !matches!(req.kind.as_str(), "stream" | "cache") {
        return Err(ApiError::invalid("kind", "stream or cache"));
    }
    let key = AssignmentKey {
        tenant_id: req.tenant_id,
        namespace: req.namespace,
        kind: req.kind,
        name: req.name,
        shard: req.shard,
    };
    let store_key = key.store_key();
    let d = st
        .store
        .get(Kind::Assignment, &store_key)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("unknown_shard: {store_key}")))?;
    let mut a: Assignment = to(&d)?;
    let now = liveness_ms();
    let mut ready = Vec::new();
    let mut leader_holds = false;
    for nd in st.store.list(Kind::Node, "").await? {
        let n: Node = to(&nd)?;
        let s = placement::standing(&n, &st.config, now, liveness_started_ms());
        if n.registration.node_id == a.leader {
            leader_holds = s.holds;
        }
        if s.ready {
            ready.push(n.registration.node_id);
        }
    }
    if leader_holds {
        return Err(ApiError::conflict(format!(
            "leader_available: {} may still hold its lease; nothing to abandon",
            a.leader
        )));
    }
    let report = st
        .reports
        .snapshot(now, st.config.report_ttl().as_millis() as u64)
        .remove(&store_key);
    if let Some(m) = a.replicas.iter().find(|m| {
        **m != a.leader && ready.contains(m) && !report.as_ref().is_some_and(|r| r.halted(m))
    }) {
        return Err(ApiError::conflict(format!(
            "member_available: placement will promote a member ({m}) that holds the data"
        )));
    }
    let ready_ids: Vec<&str> = ready.iter().map(String::as_str).collect();
    let size = a.replicas.len().max(1) as u32;
    let (leader, replicas) = placement::fresh_set(&store_key, size, &ready_ids, |_| true, |_| true)
        .ok_or_else(|| ApiError::conflict("no_ready_node: nobody can take the shard"))?;
    let previous = std::mem::replace(&mut a.leader, leader);
    a.replicas = replicas;
    // A move or restore under way was of the old set: a copy staged for it could be in
    // the new one (named twice, counted twice by brokers), or a retirement name no
    // member, and the set would stay one too large.
    (a.staging, a.replaces, a.retiring) = (None, None, None);
    a.generation += 1;
    a.abandoned = Some(a.generation);
    st.store
        .batch(vec![Op::Put {
            kind: Kind::Assignment,
            key: store_key.clone(),
            value: val(&a),
            expect: Expect::Version(d.version),
        }])
        .await?;
    // Positions in the abandoned logs mean nothing for the new one.
    st.reports.forget(&store_key);
    Ok(Json(
        json!({"lost_data": true, "previous_leader": previous, "assignment": a}),
    ))
}

// ---- Signing keys, revocation and the audit log ----------------------------------

#[derive(Serialize)]
struct KeyView {
    kid: String,
    active: bool,
    created_ms: u64,
    /// The id of the KEK that seals it (never the key itself).
    sealed_by: Option<String>,
}

async fn list_signing_keys(
    State(st): State<AppState>,
    h: HeaderMap,
    Path(t): Path<String>,
) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "tenant.manage", "tenant", &[&t])?;
    must_exist(&st, Kind::Tenant, &t).await?;
    let mut items = Vec::new();
    for d in st.store.list(Kind::SigningKey, &format!("{t}/")).await? {
        let k: StoredKey = to(&d)?;
        items.push(KeyView {
            kid: k.kid,
            active: k.active,
            created_ms: k.created_ms,
            sealed_by: k.sealed.map(|s| s.kek),
        });
    }
    Ok(Json(json!({"items": items})))
}

/// `POST /v1/tenants/{t}/signing-keys`: stages a new key. It verifies at once (brokers
/// learn it with the JWKS) but signs only once activated, so a rotation can wait until
/// every broker knows the new key before tokens signed by it appear.
async fn stage_signing_key(
    State(st): State<AppState>,
    h: HeaderMap,
    Path(t): Path<String>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let g = authenticate(&st, &h).await?;
    require(&g, "tenant.manage", "tenant", &[&t])?;
    let tenant = must_exist(&st, Kind::Tenant, &t).await?;
    let held = st
        .store
        .list(Kind::SigningKey, &format!("{t}/"))
        .await?
        .len();
    if held >= SIGNING_KEYS_MAX {
        return Err(ApiError::conflict(format!(
            "tenant {t} holds {held} signing keys, the most it may: retire one first \
             (brokers refuse a larger key set, so no retirement would reach them)"
        )));
    }
    let (op, key) = new_key_op(&st.keyring, &t, false)?;
    // Written at the tenant's version: a tenant deleted meanwhile keeps no stray key
    // (and two stagings at once cannot both pass the count above).
    st.store
        .batch(vec![
            Op::Put {
                kind: Kind::Tenant,
                key: t.clone(),
                value: tenant.value.clone(),
                expect: Expect::Version(tenant.version),
            },
            op,
        ])
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"kid": key.kid, "active": false})),
    ))
}

/// `POST /v1/tenants/{t}/signing-keys/{kid}/activate`: new tokens are signed with it;
/// the previous active key keeps verifying until retired.
async fn activate_signing_key(
    State(st): State<AppState>,
    h: HeaderMap,
    Path((t, kid)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "tenant.manage", "tenant", &[&t])?;
    let docs = st.store.list(Kind::SigningKey, &format!("{t}/")).await?;
    if !docs.iter().any(|d| d.key == format!("{t}/{kid}")) {
        return Err(ApiError::not_found(format!("tenant {t} has no key {kid}")));
    }
    let mut ops = Vec::new();
    for d in docs {
        let mut k: StoredKey = to(&d)?;
        let want = k.kid == kid;
        if k.active != want {
            k.active = want;
            ops.push(Op::Put {
                kind: Kind::SigningKey,
                key: d.key.clone(),
                value: val(&k),
                expect: Expect::Version(d.version),
            });
        }
    }
    if !ops.is_empty() {
        st.store.batch(ops).await?;
    }
    Ok(Json(json!({"kid": kid, "active": true})))
}

/// `DELETE /v1/tenants/{t}/signing-keys/{kid}`: retires a key. Tokens it signed stop
/// verifying: brokers drop it with their next key sync and close the connections that
/// authenticated with it. The active key cannot be retired (activate another first).
async fn retire_signing_key(
    State(st): State<AppState>,
    h: HeaderMap,
    Path((t, kid)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    let g = authenticate(&st, &h).await?;
    require(&g, "tenant.manage", "tenant", &[&t])?;
    let key = format!("{t}/{kid}");
    let d = st
        .store
        .get(Kind::SigningKey, &key)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("tenant {t} has no key {kid}")))?;
    let k: StoredKey = to(&d)?;
    if k.active {
        return Err(ApiError::conflict(format!(
            "{kid} is the active signing key: activate another before retiring it"
        )));
    }
    st.store
        .batch(vec![Op::Delete {
            kind: Kind::SigningKey,
            key,
            expect: Expect::Version(d.version),
        }])
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A revoked token.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Denial {
    tenant_id: String,
    jti: String,
    /// Until when (s since the epoch) the denial is kept: the token's expiry.
    until: u64,
    #[serde(default)]
    reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DenyRequest {
    jti: String,
    /// The token's expiry, when known; a denial outliving it is pointless.
    #[serde(default)]
    until: Option<u64>,
    #[serde(default)]
    reason: String,
}

/// Longest a denial is kept without a stated expiry: the longest token lifetime.
const DENIAL_MAX_SECS: u64 = 365 * 24 * 3600;

async fn denied(store: &dyn Store, tenant: &str, jti: &str) -> ApiResult<bool> {
    Ok(
        match store.get(Kind::Denial, &format!("{tenant}/{jti}")).await? {
            Some(d) => in_force(&to::<Denial>(&d)?, now_ms() / 1000),
            None => false,
        },
    )
}

/// `POST /v1/tenants/{t}/token-denials {jti, until?, reason?}`: revokes one token now,
/// for emergencies (a leaked token), without retiring the key that signed it.
async fn deny_token(
    State(st): State<AppState>,
    h: HeaderMap,
    Path(t): Path<String>,
    b: Body,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let g = authenticate(&st, &h).await?;
    require(&g, "tenant.manage", "tenant", &[&t])?;
    let operator = g.allows_object("tenant.manage", "cluster", &["*"]);
    let req: DenyRequest = body(b).await?;
    if req.jti.is_empty()
        || req.jti.len() > 128
        || !req
            .jti
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
    {
        return Err(ApiError::invalid("jti", "1-128 of [A-Za-z0-9-_]"));
    }
    let now = now_ms() / 1000;
    let until = req
        .until
        .unwrap_or(now + DENIAL_MAX_SECS)
        .min(now + DENIAL_MAX_SECS);
    let denial = Denial {
        tenant_id: t.clone(),
        jti: req.jti.clone(),
        until,
        reason: req.reason.chars().take(256).collect(),
    };
    // One already lapsed would refuse nothing, yet be stored and counted.
    if !in_force(&denial, now) {
        return Err(ApiError::invalid("until", "already past"));
    }
    let key = format!("{t}/{}", req.jti);
    let mut raced = 0;
    loop {
        // The fence first: a denial of this tenant's (or its delete) that lands after
        // it moves it, so this pass's batch fails and counts again.
        let fence = limits::fence(st.store.as_ref(), &st.counted).await?;
        must_exist(&st, Kind::Tenant, &t).await?;
        let now = now_ms() / 1000;
        let mine = st.store.list(Kind::Denial, &format!("{t}/")).await?;
        let renewed = mine.iter().find(|d| d.key == key);
        let put = |denial: &Denial, expect| Op::Put {
            kind: Kind::Denial,
            key: key.clone(),
            value: val(denial),
            expect,
        };
        // Renewing a denial in force changes no count: written at its version alone.
        // It is extended, never shortened, but by the operator: a token of the tenant
        // minted before the denial (by the denied token, say) would otherwise lift it
        // by denying it again until a moment from now.
        if let Some(d) = renewed
            && let held = to::<Denial>(d)?
            && in_force(&held, now)
        {
            let renewal = Denial {
                until: if operator {
                    denial.until
                } else {
                    denial.until.max(held.until)
                },
                ..denial.clone()
            };
            match st
                .store
                .batch(vec![put(&renewal, Expect::Version(d.version))])
                .await
            {
                Ok(_) => return Ok((StatusCode::CREATED, Json(val(&renewal)))),
                // Dropped meanwhile as lapsed (another instance's clock): counted next.
                Err(StoreError::NotFound { .. }) if raced < RACED_WRITES_MAX => raced += 1,
                Err(e) => raced_again(e, &mut raced, fence).await?,
            }
            continue;
        }
        // Otherwise counted: the tenant's denials in force against its bound, and every
        // stored one against the cluster's, the tenant's lapsed ones dropped in the same
        // batch (they refuse nothing, and would otherwise stay in the store for good).
        let mut in_force_now = 0;
        let mut ops = Vec::new();
        for d in mine.iter().filter(|d| d.key != key) {
            if in_force(&to::<Denial>(d)?, now) {
                in_force_now += 1;
            } else {
                ops.push(Op::Delete {
                    kind: Kind::Denial,
                    key: d.key.clone(),
                    expect: Expect::Version(d.version),
                });
            }
        }
        let stored =
            (fence.totals.denials + u64::from(renewed.is_none())).saturating_sub(ops.len() as u64);
        limits::room_for_denial(&t, in_force_now, stored).map_err(|e| ApiError::conflict(e.0))?;
        ops.insert(
            0,
            fence.write(limits::Totals {
                denials: stored,
                ..fence.totals
            }),
        );
        ops.push(put(
            &denial,
            renewed.map_or(Expect::Absent, |d| Expect::Version(d.version)),
        ));
        match st.store.batch(ops).await {
            Ok(_) => return Ok((StatusCode::CREATED, Json(val(&denial)))),
            Err(e) => raced_again(e, &mut raced, fence).await?,
        }
    }
}

async fn live_denials(store: &dyn Store, prefix: &str) -> ApiResult<Vec<Denial>> {
    let now = now_ms() / 1000;
    Ok(store
        .list(Kind::Denial, prefix)
        .await?
        .iter()
        .map(to::<Denial>)
        .collect::<ApiResult<Vec<_>>>()?
        .into_iter()
        .filter(|d| in_force(d, now))
        .collect())
}

/// Whether denial `d` still refuses its token at `now` (seconds): until its `until`
/// and the clock skew a token is allowed past its expiry. A denial dropped at `until`
/// let a token denied until its `exp` verify again for that minute.
fn in_force(d: &Denial, now: u64) -> bool {
    limits::denial_in_force(d.until, now)
}

async fn tenant_denials(
    State(st): State<AppState>,
    h: HeaderMap,
    Path(t): Path<String>,
) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "tenant.manage", "tenant", &[&t])?;
    let items = live_denials(st.store.as_ref(), &format!("{t}/")).await?;
    Ok(Json(json!({"items": items})))
}

/// `GET /v1/token-denials`: every live denial, for brokers (cluster view).
async fn all_denials(State(st): State<AppState>, h: HeaderMap) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "node.view", "cluster", &["*"])?;
    let items = live_denials(st.store.as_ref(), "").await?;
    Ok(Json(json!({"items": items})))
}

/// Whether `given` is the secret `expected`, in a time that does not depend on where
/// they first differ (only on their lengths).
fn same_secret(given: &[u8], expected: &[u8]) -> bool {
    given.len() == expected.len()
        && given
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// Where the bootstrap token is taken (`--bootstrap-token`): the route below names it
/// literally, as the OpenAPI test reads routes from this source.
const BOOTSTRAP_PATH: &str = "/internal/bootstrap";

/// One control-plane write, as the audit log keeps it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct AuditEntry {
    at_ms: u64,
    /// The caller's principal (`bootstrap` for the bootstrap token). Only writes whose
    /// token verifies are recorded (a 401 is not).
    principal: String,
    /// The caller's tenant.
    tenant: String,
    method: String,
    path: String,
    status: u16,
}

/// What a bearer token claims (`tid`, `sub`), read without verifying it: the handler
/// verifies; the audit log only labels the request. The bootstrap token's header labels
/// only the bootstrap call, the one handler that reads it: on any other write it is
/// ignored by the handler, and it labelled the write `bootstrap` (any caller could hide
/// who made a write that way, until 2026-12-05), and only once it bootstrapped: a
/// refused call (another method, a wrong secret, bootstrap off) with a tenant's
/// verifying token was recorded as the operator's, whose entries are never pruned
/// (until 2026-12-07).
fn claimed_caller(headers: &HeaderMap, path: &str, bootstrapped: bool) -> (String, String) {
    if bootstrapped && path == BOOTSTRAP_PATH && headers.contains_key("x-felix-bootstrap-token") {
        return ("bootstrap".into(), OPERATOR_TENANT.into());
    }
    let claims = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .and_then(|t| t.split('.').nth(1))
        .and_then(|c| b64::engine::general_purpose::URL_SAFE_NO_PAD.decode(c).ok())
        .and_then(|c| serde_json::from_slice::<Value>(&c).ok());
    match claims {
        Some(c) => (
            c["sub"].as_str().unwrap_or("").chars().take(128).collect(),
            c["tid"].as_str().unwrap_or("").chars().take(128).collect(),
        ),
        None => ("anonymous".into(), String::new()),
    }
}

/// Paths whose writes are routine broker traffic, not operator actions: a node's
/// heartbeat and replica status, by the routes' whole shape (by their last segment
/// alone, writes to a stream, cache, namespace or tenant named `heartbeat` went
/// unaudited).
fn routine(path: &str) -> bool {
    if path.starts_with("/debug/") {
        return true;
    }
    let mut parts = path.split('/');
    matches!(
        (parts.next(), parts.next(), parts.next(), parts.next(), parts.next(), parts.next()),
        (Some(""), Some("v1"), Some("nodes"), Some(id), Some("heartbeat" | "replica-status"), None)
            if !id.is_empty()
    )
}

/// Marks the answer to a request no route took: not audited.
#[derive(Debug, Clone, Copy)]
struct NoRoute;

/// The longest path an audit entry keeps (characters); a longer one is cut.
const AUDIT_PATH_MAX: usize = 1024;

/// Audit entries the store keeps of each tenant's callers: past them that tenant's
/// oldest go. Every write a verified caller makes is an entry, refused ones too, and a
/// tenant admin writing in a loop grew the log (and every read of it, which lists it
/// whole) without end. Counted per tenant, a tenant's flood pushes out only its own
/// history; the operator's entries are kept.
const AUDIT_KEPT_PER_TENANT: usize = 10_000;

/// Entries one control plane writes between two prunes: a prune lists the log, so it
/// runs once per this many (and one at a time).
const AUDIT_PRUNE_EVERY: u64 = 1_000;

/// Deletes in one batch of a prune (each is two round trips under the Postgres store's
/// write lock, which other control planes' writes wait for up to 5 s), and in one
/// prune (the rest go at the next).
const AUDIT_PRUNE_BATCH: usize = 64;
const AUDIT_PRUNE_MAX: usize = 4_096;

/// Deletes each tenant's oldest audit entries past its newest `kept` (keys sort by
/// time; the operator's entries are kept), at most [`AUDIT_PRUNE_MAX`]: how many went.
async fn prune_audit(store: &dyn Store, kept: usize) -> Result<usize, StoreError> {
    let mut by_tenant: HashMap<String, Vec<String>> = HashMap::new();
    for d in store.list(Kind::Audit, "").await? {
        let tenant = d.value["tenant"].as_str().unwrap_or_default();
        if tenant != OPERATOR_TENANT {
            by_tenant.entry(tenant.to_owned()).or_default().push(d.key);
        }
    }
    let mut excess = Vec::new();
    for keys in by_tenant.values_mut() {
        if keys.len() > kept {
            keys.sort_unstable();
            excess.extend(keys.drain(..keys.len() - kept));
        }
    }
    // The oldest first, whoever's, when there are more than one prune takes.
    excess.sort_unstable();
    excess.truncate(AUDIT_PRUNE_MAX);
    for batch in excess.chunks(AUDIT_PRUNE_BATCH) {
        store
            .batch(
                batch
                    .iter()
                    .map(|key| Op::Delete {
                        kind: Kind::Audit,
                        key: key.clone(),
                        expect: Expect::Any,
                    })
                    .collect(),
            )
            .await?;
    }
    Ok(excess.len())
}

/// Records every write (POST, PUT, PATCH, DELETE) with its outcome once answered: every
/// write a caller could make, that is. A request no route takes, or one refused whose
/// token does not verify, is not recorded: anyone could add entries without end, each
/// a store write taking every writer's lock.
async fn audit(
    State(st): State<AppState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let method = req.method().clone();
    let write = !matches!(
        method,
        axum::http::Method::GET | axum::http::Method::HEAD | axum::http::Method::OPTIONS
    );
    // Decoded as the router decodes the names in it: the tenant filter of the audit
    // log compares names, and `/v1/tenants/%61cme/…` acts on acme.
    let path = decoded_path(req.uri().path());
    // Routine by the path the router matched (raw): decoded, `/v1/nodes/x%2Fheartbeat`
    // (a node's deletion) looked like a heartbeat.
    if !write || routine(req.uri().path()) {
        return next.run(req).await;
    }
    let headers = req.headers().clone();
    let answer = next.run(req).await;
    if answer.extensions().get::<NoRoute>().is_some() {
        return answer;
    }
    // A refused write is recorded only for a caller whose token verifies: refused
    // before it was looked at (405, a body that does not parse) or for want of one
    // (401), anyone could add entries without end.
    let status = answer.status();
    if !status.is_success()
        && (status == StatusCode::UNAUTHORIZED || authenticate(&st, &headers).await.is_err())
    {
        return answer;
    }
    let bootstrapped = method == axum::http::Method::POST && status.is_success();
    let (principal, tenant) = claimed_caller(&headers, &path, bootstrapped);
    let path = match path.char_indices().nth(AUDIT_PATH_MAX) {
        Some((cut, _)) => format!("{}…", &path[..cut]),
        None => path,
    };
    let entry = AuditEntry {
        at_ms: now_ms(),
        principal,
        tenant,
        method: method.to_string(),
        path,
        status: answer.status().as_u16(),
    };
    let key = format!("{:013}-{}", entry.at_ms, random_hex(4));
    // The write has happened whatever this does; a lost entry is logged, not hidden.
    if let Err(e) = st
        .store
        .batch(vec![Op::Put {
            kind: Kind::Audit,
            key,
            value: val(&entry),
            expect: Expect::Absent,
        }])
        .await
    {
        tracing::error!(error = %e, ?entry, "audit entry not stored");
    }
    if st.audited.fetch_add(1, Ordering::Relaxed) % AUDIT_PRUNE_EVERY == AUDIT_PRUNE_EVERY - 1
        && !st.auditing.swap(true, Ordering::AcqRel)
    {
        /// Clears the prune's flag however the prune ends (a panic too).
        struct Pruned(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Pruned {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let (store, pruned) = (st.store.clone(), Pruned(st.auditing.clone()));
        tokio::spawn(async move {
            let _pruned = pruned;
            if let Err(e) = prune_audit(store.as_ref(), AUDIT_KEPT_PER_TENANT).await {
                tracing::warn!(error = %e, "pruning the audit log");
            }
        });
    }
    answer
}

#[derive(Deserialize)]
struct AuditQuery {
    #[serde(default)]
    since_ms: u64,
    /// The `next_after` of the page before: entries after that one.
    #[serde(default)]
    after: Option<String>,
    #[serde(default = "audit_page")]
    limit: usize,
}

/// `path` with its `%XX` escapes decoded (an escape that is not one stays as written).
fn decoded_path(path: &str) -> String {
    let b = path.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = (b[i] == b'%')
            .then(|| b.get(i + 1..i + 3))
            .flatten()
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex {
            Some(v) => {
                out.push(v);
                i += 3;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn audit_page() -> usize {
    500
}

async fn audit_entries(st: &AppState, q: &AuditQuery, tenant: Option<&str>) -> ApiResult<Value> {
    audit_view(st.store.list(Kind::Audit, "").await?, q, tenant)
}

/// One page of the audit log (`docs` in key order: by time, then a random id), each entry
/// with its `id`. `next_after` names the page's last entry when more follow: a reader
/// passes it back as `after`. `next_since_ms` (the first left out's millisecond) gave the
/// entries sharing it again, and a millisecond holding more than a page paged without
/// end (until 2026-12-08); it is still answered for readers written against it.
fn audit_view(docs: Vec<Doc>, q: &AuditQuery, tenant: Option<&str>) -> ApiResult<Value> {
    let limit = q.limit.clamp(1, 5000);
    let mut items = Vec::new();
    let mut next = None;
    for d in docs {
        if q.after.as_ref().is_some_and(|after| d.key <= *after) {
            continue;
        }
        let e: AuditEntry = to(&d)?;
        if e.at_ms < q.since_ms {
            continue;
        }
        // A tenant's view: its own callers' writes, and the operator's to its paths.
        // Another tenant's callers writing to its paths (all refused) stay out of it:
        // they named that tenant and its principals.
        if let Some(t) = tenant
            && e.tenant != t
            && !(e.tenant == OPERATOR_TENANT
                && (e.path.starts_with(&format!("/v1/tenants/{t}/"))
                    || e.path == format!("/v1/tenants/{t}")))
        {
            continue;
        }
        if items.len() == limit {
            next = Some(e.at_ms);
            break;
        }
        let mut item = val(&e);
        item["id"] = Value::String(d.key);
        items.push(item);
    }
    let after = next.and(items.last().map(|i| i["id"].clone()));
    Ok(json!({"items": items, "next_after": after, "next_since_ms": next}))
}

/// `GET /v1/audit?since_ms=&after=&limit=`: every write, oldest first (operators), each
/// entry with its `id`; `next_after` names the next page's start.
async fn audit_log(
    State(st): State<AppState>,
    h: HeaderMap,
    Query(q): Query<AuditQuery>,
) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "tenant.manage", "cluster", &["*"])?;
    Ok(Json(audit_entries(&st, &q, None).await?))
}

/// `GET /v1/tenants/{t}/audit`: the writes made by or to one tenant.
async fn tenant_audit_log(
    State(st): State<AppState>,
    h: HeaderMap,
    Path(t): Path<String>,
    Query(q): Query<AuditQuery>,
) -> ApiResult<Json<Value>> {
    let g = authenticate(&st, &h).await?;
    require(&g, "tenant.manage", "tenant", &[&t])?;
    Ok(Json(audit_entries(&st, &q, Some(&t)).await?))
}

/// The router.
pub fn router(state: AppState) -> Router {
    let debug = if state.config.fault_injection {
        Router::new().route("/debug/clock", post(debug_clock))
    } else {
        Router::new()
    };
    debug
        .route("/v1/system/live", get(live))
        .route("/v1/system/ready", get(ready))
        .route("/v1/system/health", get(ready))
        .route("/v1/openapi.json", get(openapi))
        .route("/internal/bootstrap", post(bootstrap))
        .route("/v1/tenants", get(list_tenants).post(create_tenant))
        .route("/v1/tenants/snapshot", get(tenants_snapshot))
        .route("/v1/tenants/{t}", axum::routing::delete(delete_tenant))
        .route("/v1/tenants/{t}/.well-known/jwks.json", get(jwks))
        .route("/v1/tenants/{t}/tokens", post(issue_token))
        .route(
            "/v1/tenants/{t}/signing-keys",
            get(list_signing_keys).post(stage_signing_key),
        )
        .route(
            "/v1/tenants/{t}/signing-keys/{kid}/activate",
            post(activate_signing_key),
        )
        .route(
            "/v1/tenants/{t}/signing-keys/{kid}",
            axum::routing::delete(retire_signing_key),
        )
        .route(
            "/v1/tenants/{t}/token-denials",
            get(tenant_denials).post(deny_token),
        )
        .route("/v1/token-denials", get(all_denials))
        .route("/v1/audit", get(audit_log))
        .route("/v1/tenants/{t}/audit", get(tenant_audit_log))
        .route(
            "/v1/tenants/{t}/namespaces",
            get(list_namespaces).post(create_namespace),
        )
        .route(
            "/v1/tenants/{t}/namespaces/{ns}",
            axum::routing::delete(delete_namespace),
        )
        .route(
            "/v1/tenants/{t}/namespaces/{ns}/streams",
            get(list_streams).post(create_stream),
        )
        .route(
            "/v1/tenants/{t}/namespaces/{ns}/streams/{s}",
            get(get_stream).patch(patch_stream).delete(delete_stream),
        )
        .route(
            "/v1/tenants/{t}/namespaces/{ns}/caches",
            get(list_caches).post(create_cache),
        )
        .route(
            "/v1/tenants/{t}/namespaces/{ns}/caches/{c}",
            get(get_cache).delete(delete_cache),
        )
        .route("/v1/streams/snapshot", get(streams_snapshot))
        .route("/v1/nodes", get(list_nodes).post(register_node))
        .route("/v1/nodes/{id}", get(get_node).delete(delete_node))
        .route("/v1/nodes/{id}/heartbeat", post(heartbeat))
        .route("/v1/nodes/{id}/drain", post(drain_node))
        .route("/v1/shard-assignments", get(list_assignments))
        .route("/v1/shard-assignments/snapshot", get(assignments_snapshot))
        .route("/v1/shard-assignments/changes", get(assignment_changes))
        .route("/v1/shard-moves", post(shard_move))
        .route("/v1/nodes/{id}/replica-status", post(replica_status))
        .route("/v1/placement/replication", get(replication_view))
        .route("/v1/placement/abandon", post(abandon))
        .fallback(|| async {
            let mut answer = ApiError::not_found("no such endpoint").into_response();
            answer.extensions_mut().insert(NoRoute);
            answer
        })
        .layer(axum::middleware::from_fn_with_state(state.clone(), audit))
        .with_state(state)
}

#[cfg(test)]
mod tests {
    /// The audit log keeps each tenant's newest entries: a prune deletes a tenant's
    /// oldest past its bound, in batches, leaves another tenant within it and the
    /// operator's entries alone (a tenant's flood pushes out only its own history).
    #[tokio::test]
    async fn a_prune_keeps_each_tenants_newest_audit_entries() {
        use super::*;
        let store = crate::store::MemoryStore::new();
        let key = |i: usize| format!("{:013}-{i:04x}", 1_000_000 + i);
        let tenant = |i: usize| match i % 10 {
            0 | 1 => "operator",
            2 => "quiet",
            _ => "loud",
        };
        let put = |i: usize| Op::Put {
            kind: Kind::Audit,
            key: key(i),
            value: json!({"tenant": tenant(i)}),
            expect: Expect::Absent,
        };
        store.batch((0..1000).map(put).collect()).await.unwrap();
        assert_eq!(prune_audit(&store, 700).await.unwrap(), 0);
        assert_eq!(prune_audit(&store, 150).await.unwrap(), 550);
        let left: std::collections::BTreeSet<String> = store
            .list(Kind::Audit, "")
            .await
            .unwrap()
            .into_iter()
            .map(|d| d.key)
            .collect();
        let loud: Vec<usize> = (0..1000).filter(|i| tenant(*i) == "loud").collect();
        let want: std::collections::BTreeSet<String> = (0..1000)
            .filter(|i| tenant(*i) != "loud" || loud[loud.len() - 150..].contains(i))
            .map(key)
            .collect();
        assert_eq!(
            left, want,
            "the loud tenant's newest 150, the quiet one's 100, the operator's 200"
        );
    }

    /// Paging by `next_after` gives each entry once, and ends, even where one
    /// millisecond holds more entries than a page (by `next_since_ms` such a log paged
    /// without end); a tenant's view pages over its own entries alike.
    #[test]
    fn audit_pages_give_each_entry_once_when_a_millisecond_holds_more_than_a_page() {
        use super::*;
        let entry = |i: usize| {
            let (at_ms, tenant) = (1_000 + (i as u64 >= 12) as u64, ["acme", "globex"][i % 2]);
            Doc {
                key: format!("{at_ms:013}-{i:04x}"),
                version: 1,
                value: json!({"at_ms": at_ms, "principal": "p", "tenant": tenant,
                    "method": "POST", "path": format!("/v1/tenants/{tenant}/x"), "status": 201}),
            }
        };
        let docs: Vec<Doc> = (0..14).map(entry).collect();
        let pages = |tenant: Option<&str>| {
            let mut q = AuditQuery {
                since_ms: 0,
                after: None,
                limit: 5,
            };
            let (mut seen, mut pages) = (Vec::new(), 0);
            loop {
                let page = audit_view(docs.clone(), &q, tenant).unwrap();
                pages += 1;
                assert!(pages <= 10, "paging ends: {seen:?}");
                for item in page["items"].as_array().unwrap() {
                    seen.push(item["id"].as_str().unwrap().to_owned());
                }
                match page["next_after"].as_str() {
                    Some(after) => q.after = Some(after.to_owned()),
                    None => break (seen, pages),
                }
            }
        };
        let all: Vec<String> = docs.iter().map(|d| d.key.clone()).collect();
        assert_eq!(pages(None), (all.clone(), 3));
        let acme: Vec<String> = all.iter().step_by(2).cloned().collect();
        assert_eq!(pages(Some("acme")), (acme, 2));
        // The older field still names the first millisecond left out.
        let q = AuditQuery {
            since_ms: 0,
            after: None,
            limit: 5,
        };
        assert_eq!(audit_view(docs, &q, None).unwrap()["next_since_ms"], 1_000);
    }

    /// The pause before a counted write tries again: under a ceiling of 5 ms that
    /// doubles each try up to 320 ms; random within it.
    #[test]
    fn a_raced_write_pauses_under_a_doubling_ceiling() {
        use super::{RACED_PAUSE_MAX, raced_pause, random_unit};
        let ceilings: Vec<u64> = (0..9)
            .map(|raced| raced_pause(raced, 0.999_999).as_millis() as u64)
            .collect();
        assert_eq!(ceilings, [4, 9, 19, 39, 79, 159, 319, 319, 319]);
        assert_eq!(raced_pause(3, 0.0), std::time::Duration::ZERO);
        assert!(raced_pause(u32::MAX, 1.0) <= RACED_PAUSE_MAX);
        let units: Vec<f64> = (0..64).map(|_| random_unit()).collect();
        assert!(units.iter().all(|u| (0.0..1.0).contains(u)), "{units:?}");
        assert!(
            units.windows(2).any(|w| w[0] != w[1]),
            "random units vary: {units:?}"
        );
    }

    use super::*;
    use futures_lite::StreamExt as _;

    /// A body that stops arriving is answered 408 once its time is up, not waited for
    /// as long as the connection lasts.
    #[tokio::test]
    async fn a_body_that_stops_arriving_is_refused_in_time() {
        let stalled =
            futures_lite::stream::once(Ok::<_, std::io::Error>(Bytes::from_static(b"{\"a\":")))
                .chain(futures_lite::stream::pending());
        let got = tokio::time::timeout(
            Duration::from_secs(5),
            body_within::<Value>(Body::from_stream(stalled), Duration::from_millis(100)),
        )
        .await
        .expect("the body read waited on");
        let e = got.expect_err("a half body");
        assert_eq!(e.status, StatusCode::REQUEST_TIMEOUT);
    }

    /// At the cluster's bounds, with every name, node id, replica set and optional field
    /// at its longest, each answer a broker reads whole fits what it reads
    /// ([`crate::client::MAX_ANSWER_BYTES`]): the assignment snapshot and replication
    /// view (one item a shard), the streams snapshot (one a stream or cache, each at
    /// least a shard), the denials in force.
    #[test]
    fn the_bounds_keep_every_snapshot_a_broker_reads_whole() {
        use crate::limits::{CLUSTER_DENIALS_MAX, CLUSTER_SHARDS_MAX};
        use crate::replication::{FollowerReport, ShardReport};

        let longest = |c: char| c.to_string().repeat(128);
        let node = |i: usize| format!("{i:02}{}", "n".repeat(126));
        // Eight: a move's retiring member stays in the set until it is removed.
        let replicas: Vec<String> = (0..8).map(node).collect();
        let key = AssignmentKey {
            tenant_id: longest('t'),
            namespace: longest('s'),
            kind: "stream".into(),
            name: longest('x'),
            shard: u32::MAX,
        };
        let a = Assignment {
            key: key.clone(),
            leader: node(0),
            replicas: replicas.clone(),
            generation: u64::MAX,
            state: "active".into(),
            routing: Some(felix_wire::routing::ShardRouting::JumpHash),
            staging: Some(node(8)),
            replaces: Some(node(9)),
            retiring: Some(node(7)),
            abandoned: Some(u64::MAX),
            handoff: Some(Handoff {
                from: node(10),
                generation: u64::MAX,
            }),
        };
        let report = StoredReport {
            from: node(0),
            received_ms: 0,
            report: ShardReport {
                kind: key.kind.clone(),
                tenant_id: key.tenant_id.clone(),
                namespace: key.namespace.clone(),
                name: key.name.clone(),
                shard: key.shard,
                generation: u64::MAX,
                log_end: u64::MAX,
                commit: u64::MAX,
                generation_committed: true,
                followers: replicas
                    .iter()
                    .chain([&node(8)])
                    .map(|n| FollowerReport {
                        node_id: n.clone(),
                        durable_end: u64::MAX,
                        halted: true,
                        staged: true,
                        rebuilding: true,
                    })
                    .collect(),
                cannot_lead: true,
            },
        };
        // An item's bytes and the comma after it.
        let size = |v: &Value| serde_json::to_vec(v).unwrap().len() as u64 + 1;
        let bound = crate::client::MAX_ANSWER_BYTES - 4096;
        let shards = CLUSTER_SHARDS_MAX;

        let snapshot = size(&snapshot_item(&a, |_| false, Some(&report)));
        assert!(snapshot * shards <= bound, "{snapshot} bytes a shard");
        let view = size(&view_item(&a, |_| true, Some(&report), u64::MAX));
        assert!(view * shards <= bound, "{view} bytes a shard");

        let retention = Retention {
            max_age_seconds: Some(u64::MAX),
            max_size_bytes: Some(u64::MAX),
        };
        let stream = Stream {
            tenant_id: longest('t'),
            namespace: longest('s'),
            spec: StreamCreate {
                stream: longest('x'),
                kind: "Stream".into(),
                shards: 1,
                replication_factor: 7,
                retention,
                consistency: Consistency::Quorum,
                delivery: "AtLeastOnce".into(),
                durable: true,
                routing: felix_wire::routing::ShardRouting::JumpHash,
            },
            version: u64::MAX,
            incarnation: random_hex(8),
        };
        let cache = Cache {
            tenant_id: longest('t'),
            namespace: longest('s'),
            spec: CacheCreate {
                cache: longest('x'),
                // Control characters, escaped six bytes each.
                display_name: "\u{1}".repeat(DISPLAY_NAME_MAX_BYTES),
                shards: 1,
                replication_factor: 7,
                consistency: Consistency::Quorum,
            },
            version: u64::MAX,
            incarnation: random_hex(8),
        };
        let streams = size(&val(&stream)).max(size(&val(&cache)));
        assert!(
            streams * shards <= bound,
            "{streams} bytes a stream or cache"
        );

        let denial = Denial {
            tenant_id: longest('t'),
            jti: longest('j'),
            until: u64::MAX,
            reason: "\u{1}".repeat(256),
        };
        let denials = size(&val(&denial));
        assert!(
            denials * CLUSTER_DENIALS_MAX <= bound,
            "{denials} bytes a denial"
        );
    }
}
