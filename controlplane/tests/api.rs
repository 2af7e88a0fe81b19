//! Every endpoint, RBAC refusal and conflict, run against the in-memory store and
//! against a real Postgres (started by `tests/postgres/setup.sh`).

use std::sync::Arc;
use std::time::Duration;

use felix_controlplane::api::ApiConfig;
use felix_controlplane::client::{ClientError, ControlPlaneClient};
use felix_controlplane::model::{Assignment, Handoff};
use felix_controlplane::placement;
use felix_controlplane::replication::ReplicaReports;
use felix_controlplane::server::{self, KeySource, ServerConfig};
use felix_controlplane::store::{
    BoxFut, CHANGES_KEPT, Change, Doc, Expect, Kind, MemoryStore, Op, Store,
};
use serde_json::{Value, json};

const BOOTSTRAP: &str = "bootstrap-secret-0123456789";
const TEST_KEK: [u8; 32] = [0x42; 32];

struct Service {
    url: String,
    store: Arc<dyn Store>,
    reports: ReplicaReports,
    config: ApiConfig,
    rt: tokio::runtime::Runtime,
    running: Option<server::Running>,
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            self.rt.block_on(r.stop());
        }
    }
}

fn start(store: Arc<dyn Store>, rt: tokio::runtime::Runtime) -> Service {
    let config = ApiConfig {
        bootstrap_token: Some(BOOTSTRAP.into()),
        heartbeat_interval: Duration::from_millis(200),
        // Down after 1000 + 250 ms (the default margin, a quarter) of silence.
        expiry_timeout: Duration::from_millis(1000),
        regrant_margin: None,
        // Members silent for 1000 + 300 ms are replaced.
        replica_restore_after: Duration::from_millis(300),
        fault_injection: false,
    };
    let running = rt
        .block_on(server::start_with_store(
            ServerConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                api: config.clone(),
                // Passes are driven by hand below.
                placement_interval: Duration::from_secs(3600),
                // One KEK for every service in the run: a second service over the same
                // database opens what the first sealed.
                keys: KeySource::Material {
                    current: TEST_KEK,
                    previous: Vec::new(),
                },
                ..ServerConfig::default()
            },
            store.clone(),
        ))
        .unwrap();
    Service {
        url: format!("http://{}", running.addr),
        store,
        reports: running.reports.clone(),
        config,
        rt,
        running: Some(running),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn memory_service() -> Service {
    start(Arc::new(MemoryStore::new()), runtime())
}

fn setup_script(args: &[&str]) -> String {
    let script = manifest_dir().join("../tests/postgres/setup.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("running tests/postgres/setup.sh");
    assert!(out.status.success(), "tests/postgres/setup.sh failed");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// The test Postgres's URL (plain, for administration) and its TLS CA file.
fn test_postgres() -> (String, String) {
    let base = std::env::var("FELIX_TEST_POSTGRES_URL").unwrap_or_else(|_| setup_script(&[]));
    let ca = std::env::var("FELIX_TEST_POSTGRES_CA").unwrap_or_else(|_| setup_script(&["--ca"]));
    (base, ca)
}

/// A fresh database on the test Postgres, so runs never see each other's rows. The
/// store reaches it over TLS (`sslmode=verify-full`), as production should.
fn postgres_service() -> Service {
    let (url, rt) = fresh_database();
    let (_, ca) = test_postgres();
    let store = rt
        .block_on(felix_controlplane::pg::PgStore::connect(&format!(
            "{url}?sslmode=verify-full&sslrootcert={ca}"
        )))
        .expect("opening the postgres store over TLS");
    start(Arc::new(store), rt)
}

fn fresh_database() -> (String, tokio::runtime::Runtime) {
    let (base, _) = test_postgres();
    let rt = runtime();
    let db = format!(
        "felix_test_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
            % 1_000_000_000
    );
    let url = rt.block_on(async {
        let (c, conn) = tokio_postgres::connect(&base, tokio_postgres::NoTls)
            .await
            .expect("connecting to the test postgres");
        tokio::spawn(conn);
        c.batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .unwrap();
        let (prefix, _) = base.rsplit_once('/').unwrap();
        format!("{prefix}/{db}")
    });
    (url, rt)
}

/// The Postgres store on the database at `url`, over TLS (`sslmode=verify-full`).
fn postgres_store_at(url: &str, rt: &tokio::runtime::Runtime) -> felix_controlplane::pg::PgStore {
    let (_, ca) = test_postgres();
    rt.block_on(felix_controlplane::pg::PgStore::connect(&format!(
        "{url}?sslmode=verify-full&sslrootcert={ca}"
    )))
    .expect("opening the postgres store over TLS")
}

/// Feed reads waiting on the Postgres store (every broker's long poll) share one poll
/// of the change log's head: each polled on its own every 50 ms before, two queries a
/// time on the store's one connection, which every heartbeat waits for too. A write,
/// by this instance or another, still ends the waits.
#[test]
fn waiting_feed_reads_share_one_poll_of_the_postgres_store() {
    let (url, rt) = fresh_database();
    let (a, b) = (
        Arc::new(postgres_store_at(&url, &rt)),
        Arc::new(postgres_store_at(&url, &rt)),
    );
    let wait_from = |store: &Arc<felix_controlplane::pg::PgStore>, since: u64, wait: Duration| {
        let store = store.clone();
        rt.spawn(async move {
            let started = std::time::Instant::now();
            let (page, _) = store
                .changes(Kind::Assignment, since, 1000, wait)
                .await
                .unwrap();
            (page, started.elapsed())
        })
    };
    let wait =
        |store: &Arc<felix_controlplane::pg::PgStore>, wait: Duration| wait_from(store, 0, wait);
    let before = a.operations();
    let reads: Vec<_> = (0..16).map(|_| wait(&a, Duration::from_secs(1))).collect();
    for r in reads {
        assert!(rt.block_on(r).unwrap().0.is_empty());
    }
    // A read at each waiter's start and end, and about 20 polls for all of them (it
    // was 16 x 21).
    let ops = a.operations() - before;
    assert!(ops <= 80, "{ops} store operations for 16 reads waiting 1 s");
    let put = |store: &Arc<felix_controlplane::pg::PgStore>, key: &str| {
        rt.block_on(store.batch(vec![Op::Put {
            kind: Kind::Assignment,
            key: key.into(),
            value: json!({"k": key}),
            expect: Expect::Any,
        }]))
        .unwrap();
    };
    for (writer, key) in [(&a, "mine"), (&b, "another-instances")] {
        // From the head: each read must wait for this write.
        let head = rt.block_on(a.head()).unwrap();
        let reads: Vec<_> = (0..4)
            .map(|_| wait_from(&a, head, Duration::from_secs(10)))
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        put(writer, key);
        for r in reads {
            let (page, took) = rt.block_on(r).unwrap();
            assert_eq!(page.first().map(|c| c.key.as_str()), Some(key));
            assert!(
                took < Duration::from_secs(2),
                "a wait outlived a write ({key}) by {took:?}"
            );
        }
    }
    // The log's head goes back (a database restored from before those writes): the
    // waits still wait. (They ended at once while the head stood below the highest
    // seen, each waiter reading again in a loop.)
    rt.block_on(async {
        let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        c.execute("DELETE FROM felix_changes", &[]).await.unwrap();
    });
    let before = a.operations();
    let reads: Vec<_> = (0..16).map(|_| wait(&a, Duration::from_secs(1))).collect();
    for r in reads {
        assert!(rt.block_on(r).unwrap().0.is_empty());
    }
    let ops = a.operations() - before;
    assert!(
        ops <= 100,
        "{ops} store operations for 16 reads waiting 1 s behind a head that went back"
    );
}

#[test]
fn the_postgres_store_speaks_tls_and_refuses_a_server_it_cannot_verify() {
    let (url, rt) = fresh_database();
    let (base, ca) = test_postgres();
    let db = url.rsplit_once('/').unwrap().1.to_owned();
    let _store = rt
        .block_on(felix_controlplane::pg::PgStore::connect(&format!(
            "{url}?sslmode=verify-full&sslrootcert={ca}"
        )))
        .unwrap();
    // The server sees the store's session as TLS.
    let tls_sessions: i64 = rt.block_on(async {
        let (c, conn) = tokio_postgres::connect(&base, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        c.query_one(
            "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
             WHERE a.datname = $1 AND s.ssl",
            &[&db],
        )
        .await
        .unwrap()
        .get(0)
    });
    assert_eq!(tls_sessions, 1);
    // A CA that did not sign the server's certificate (here: the leaf itself) is refused.
    let leaf = std::path::Path::new(&ca).with_file_name("server.crt");
    let e = rt
        .block_on(felix_controlplane::pg::PgStore::connect(&format!(
            "{url}?sslmode=verify-full&sslrootcert={}",
            leaf.display()
        )))
        .unwrap_err();
    assert!(e.to_string().contains("certificate"), "{e}");
    // A name the certificate does not carry is refused too (it names localhost and
    // 127.0.0.1, not 127.0.0.2).
    let e = rt
        .block_on(felix_controlplane::pg::PgStore::connect(&format!(
            "{}?sslmode=verify-full&sslrootcert={ca}",
            url.replace("127.0.0.1", "127.0.0.2")
        )))
        .unwrap_err();
    assert!(
        e.to_string().contains("certificate") || e.to_string().contains("connect"),
        "{e}"
    );
    // Encryption without verification is refused before connecting.
    let e = rt
        .block_on(felix_controlplane::pg::PgStore::connect(&format!(
            "{url}?sslmode=require"
        )))
        .unwrap_err();
    assert!(e.to_string().contains("verify-full"), "{e}");
}

fn status(r: Result<Value, ClientError>) -> (u16, Option<String>, Option<String>) {
    match r {
        Ok(_) => (200, None, None),
        Err(ClientError::Api {
            status,
            code,
            field,
            ..
        }) => (status, Some(code), field),
        Err(e) => panic!("transport error: {e}"),
    }
}

fn expect_err(r: Result<Value, ClientError>, want: u16) -> (Option<String>, Option<String>) {
    let (s, code, field) = status(r);
    assert_eq!(s, want, "expected HTTP {want}, got {s} ({code:?})");
    (code, field)
}

fn scenario(svc: &Service) {
    let anon = ControlPlaneClient::new(&svc.url, None).unwrap();

    // Health and the document need no token.
    assert_eq!(anon.get("/v1/system/live").unwrap()["status"], "live");
    assert_eq!(anon.get("/v1/system/ready").unwrap()["status"], "ready");
    assert_eq!(anon.get("/v1/system/health").unwrap()["status"], "ready");
    let doc = anon.get("/v1/openapi.json").unwrap();
    assert!(doc["paths"]["/v1/shard-assignments/changes"].is_object());
    expect_err(anon.get("/v1/no-such-thing"), 404);

    // Everything else needs a token.
    let (code, _) = expect_err(anon.get("/v1/tenants"), 401);
    assert_eq!(code.as_deref(), Some("unauthenticated"));
    expect_err(
        anon.clone().with_token("not.a.token").get("/v1/tenants"),
        401,
    );

    // Bootstrap: wrong secret, then once, then never again.
    expect_err(
        anon.post_with(
            "/internal/bootstrap",
            &json!({}),
            &[("X-Felix-Bootstrap-Token", "wrong")],
        ),
        401,
    );
    expect_err(anon.post("/internal/bootstrap", &json!({})), 401);
    let boot = anon
        .post_with(
            "/internal/bootstrap",
            &json!({}),
            &[("X-Felix-Bootstrap-Token", BOOTSTRAP)],
        )
        .unwrap();
    let admin = anon.clone().with_token(boot["token"].as_str().unwrap());
    expect_err(
        anon.post_with(
            "/internal/bootstrap",
            &json!({}),
            &[("X-Felix-Bootstrap-Token", BOOTSTRAP)],
        ),
        409,
    );

    // Tenants.
    assert_eq!(
        admin
            .post(
                "/v1/tenants",
                &json!({"tenant_id": "acme", "display_name": "Acme"})
            )
            .unwrap()["tenant_id"],
        "acme"
    );
    admin
        .post("/v1/tenants", &json!({"tenant_id": "globex"}))
        .unwrap();
    expect_err(
        admin.post("/v1/tenants", &json!({"tenant_id": "acme"})),
        409,
    );
    let (_, field) = expect_err(
        admin.post("/v1/tenants", &json!({"tenant_id": "bad name"})),
        400,
    );
    assert_eq!(field.as_deref(), Some("tenant_id"));
    let (_, field) = expect_err(
        admin.post("/v1/tenants", &json!({"display_name": "x"})),
        400,
    );
    assert_eq!(
        field.as_deref(),
        Some("tenant_id"),
        "a missing field is named"
    );
    let (_, field) = expect_err(admin.post("/v1/tenants", &json!({"tenant": "x"})), 400);
    assert_eq!(
        field.as_deref(),
        Some("tenant"),
        "a misspelt field is named, not dropped"
    );
    let names: Vec<String> = admin.get("/v1/tenants").unwrap()["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["tenant_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["acme", "globex", "operator"]);
    // The change log's position (it logs assignments only, none yet on Postgres).
    assert!(
        admin.get("/v1/tenants/snapshot").unwrap()["next_seq"]
            .as_u64()
            .is_some()
    );

    // JWKS is public; unknown tenants are 404.
    let jwks = anon.get("/v1/tenants/acme/.well-known/jwks.json").unwrap();
    assert_eq!(jwks["keys"][0]["kty"], "OKP");
    expect_err(anon.get("/v1/tenants/nobody/.well-known/jwks.json"), 404);

    // Tokens: the operator issues a tenant admin; bad audiences, TTLs and perms that
    // reach outside the tenant are refused.
    let issue = |c: &ControlPlaneClient, t: &str, body: Value| {
        c.post(&format!("/v1/tenants/{t}/tokens"), &body)
    };
    let acme_admin = admin.clone().with_token(
        issue(&admin, "acme", json!({"sub": "alice", "audience": "felix-controlplane", "perms": ["tenant.manage:tenant:acme"]})).unwrap()["token"]
            .as_str()
            .unwrap(),
    );
    let (_, field) = expect_err(
        issue(
            &admin,
            "acme",
            json!({"sub": "a", "audience": "somewhere", "perms": []}),
        ),
        400,
    );
    assert_eq!(field.as_deref(), Some("audience"));
    let (_, field) = expect_err(
        issue(
            &admin,
            "acme",
            json!({"sub": "a", "audience": "felix-broker", "perms": [], "ttl_seconds": 0}),
        ),
        400,
    );
    assert_eq!(field.as_deref(), Some("ttl_seconds"));
    expect_err(
        issue(
            &acme_admin,
            "acme",
            json!({"sub": "a", "audience": "felix-broker", "perms": ["stream.publish:stream:globex/*/*"]}),
        ),
        403,
    );
    expect_err(
        issue(
            &acme_admin,
            "acme",
            json!({"sub": "a", "audience": "felix-broker", "perms": ["node.manage:cluster:*"]}),
        ),
        403,
    );
    expect_err(
        issue(
            &acme_admin,
            "globex",
            json!({"sub": "a", "audience": "felix-broker", "perms": []}),
        ),
        403,
    );
    let broker_token = issue(&acme_admin, "acme", json!({"sub": "app", "audience": "felix-broker", "perms": ["stream.publish:stream:acme/*/*"]})).unwrap();
    // (No longer than acme_admin's own hour, which began a moment before.)
    let given = broker_token["expires_in"].as_u64().unwrap();
    assert!((3590..=3600).contains(&given), "{broker_token}");
    // A broker-audience token is not accepted here.
    expect_err(
        anon.clone()
            .with_token(broker_token["token"].as_str().unwrap())
            .get("/v1/tenants/acme/namespaces"),
        401,
    );

    // A tenant admin stays inside its tenant.
    expect_err(acme_admin.get("/v1/tenants"), 403);
    expect_err(acme_admin.delete("/v1/tenants/globex"), 403);

    // Namespaces.
    assert_eq!(
        acme_admin
            .post(
                "/v1/tenants/acme/namespaces",
                &json!({"namespace": "payments"})
            )
            .unwrap()["tenant_id"],
        "acme"
    );
    expect_err(
        acme_admin.post(
            "/v1/tenants/acme/namespaces",
            &json!({"namespace": "payments"}),
        ),
        409,
    );
    expect_err(
        acme_admin.post("/v1/tenants/globex/namespaces", &json!({"namespace": "x"})),
        403,
    );
    expect_err(
        admin.post("/v1/tenants/nobody/namespaces", &json!({"namespace": "x"})),
        404,
    );
    let (_, field) = expect_err(
        acme_admin.post("/v1/tenants/acme/namespaces", &json!({"namespace": "-x"})),
        400,
    );
    assert_eq!(field.as_deref(), Some("namespace"));
    // A field the body does not have is refused by name, not dropped.
    let (_, field) = expect_err(
        acme_admin.post(
            "/v1/tenants/acme/namespaces",
            &json!({"namespace": "ledger", "display_nmae": "Ledger"}),
        ),
        400,
    );
    assert_eq!(field.as_deref(), Some("display_nmae"));
    let (_, field) = expect_err(
        admin.post(
            "/v1/tenants",
            &json!({"tenant_id": "initech", "displayName": "Initech"}),
        ),
        400,
    );
    assert_eq!(field.as_deref(), Some("displayName"));
    assert_eq!(
        acme_admin.get("/v1/tenants/acme/namespaces").unwrap()["items"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    // Streams: validation names the field, duplicates conflict, updates are versioned.
    let streams = "/v1/tenants/acme/namespaces/payments/streams";
    let stream = |name: &str, shards: u32| json!({"stream": name, "kind": "Stream", "shards": shards, "replication_factor": 1});
    let (_, field) = expect_err(acme_admin.post(streams, &stream("orders", 0)), 400);
    assert_eq!(field.as_deref(), Some("shards"));
    let (_, field) = expect_err(
        acme_admin.post(
            streams,
            &json!({"stream": "orders", "kind": "Table", "shards": 1}),
        ),
        400,
    );
    assert_eq!(field.as_deref(), Some("kind"));
    let (_, field) = expect_err(
        acme_admin.post(
            streams,
            &json!({"stream": "orders", "kind": "Stream", "shards": 1, "colour": "red"}),
        ),
        400,
    );
    assert_eq!(
        field.as_deref(),
        Some("colour"),
        "unknown fields are refused by name"
    );
    let (_, field) = expect_err(acme_admin.post(streams, &json!({"stream": "orders", "kind": "Stream", "shards": 1, "retention": {"max_age_seconds": 0}})), 400);
    assert_eq!(field.as_deref(), Some("retention.max_age_seconds"));
    expect_err(
        acme_admin.post(
            "/v1/tenants/acme/namespaces/nope/streams",
            &stream("orders", 1),
        ),
        404,
    );
    let created = acme_admin
        .post(streams, &json!({"stream": "orders", "kind": "Stream", "shards": 4, "replication_factor": 2, "routing": "jump_hash"}))
        .unwrap();
    assert_eq!(created["shards"], 4);
    let v1 = created["version"].as_u64().unwrap();
    expect_err(acme_admin.post(streams, &stream("orders", 4)), 409);
    let (_, field) = expect_err(
        acme_admin.post(
            streams,
            &json!({"stream": "big", "kind": "Stream", "shards": 1, "pad": "x".repeat(70_000)}),
        ),
        413,
    );
    assert_eq!(field, None);
    let got = acme_admin.get(&format!("{streams}/orders")).unwrap();
    assert_eq!(
        (got["version"].as_u64(), got["routing"].as_str()),
        (Some(v1), Some("jump_hash"))
    );
    expect_err(acme_admin.get(&format!("{streams}/missing")), 404);
    expect_err(
        acme_admin.patch(
            &format!("{streams}/orders"),
            &json!({"durable": false, "version": v1 + 7}),
        ),
        409,
    );
    // Durability is set at creation: flipped to false, a one-copy stream whose broker
    // went down would be reopened empty elsewhere (only the operator's abandon may).
    let (_, field) = expect_err(
        acme_admin.patch(
            &format!("{streams}/orders"),
            &json!({"durable": false, "version": v1}),
        ),
        400,
    );
    assert_eq!(field.as_deref(), Some("durable"));
    let patched = acme_admin
        .patch(
            &format!("{streams}/orders"),
            &json!({"durable": true, "retention": {"max_age_seconds": 60}, "version": v1}),
        )
        .unwrap();
    assert_eq!(patched["durable"].as_bool(), Some(true));
    assert_eq!(patched["retention"]["max_age_seconds"].as_u64(), Some(60));
    assert!(patched["version"].as_u64() > Some(v1), "{patched}");
    let (_, field) = expect_err(
        acme_admin.patch(
            &format!("{streams}/orders"),
            &json!({"delivery": "Sometimes"}),
        ),
        400,
    );
    assert_eq!(field.as_deref(), Some("delivery"));
    expect_err(
        acme_admin.patch(&format!("{streams}/orders"), &json!({"shards": 8})),
        400,
    );
    assert_eq!(
        acme_admin.get(streams).unwrap()["items"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    // A token scoped to one namespace's streams.
    let narrow = admin.clone().with_token(
        issue(&acme_admin, "acme", json!({"sub": "ci", "audience": "felix-controlplane", "perms": ["stream.manage:stream:acme/payments/orders"]})).unwrap()["token"]
            .as_str()
            .unwrap(),
    );
    narrow.get(&format!("{streams}/orders")).unwrap();
    expect_err(narrow.post(streams, &stream("other", 1)), 403);
    expect_err(
        narrow.get("/v1/tenants/acme/namespaces/payments/caches"),
        403,
    );

    // Caches.
    let caches = "/v1/tenants/acme/namespaces/payments/caches";
    let c = acme_admin
        .post(caches, &json!({"cache": "sessions", "shards": 2}))
        .unwrap();
    assert_eq!(c["shards"], 2);
    expect_err(acme_admin.post(caches, &json!({"cache": "sessions"})), 409);
    let (_, field) = expect_err(
        acme_admin.post(caches, &json!({"cache": "c2", "replication_factor": 9})),
        400,
    );
    assert_eq!(field.as_deref(), Some("replication_factor"));
    assert_eq!(
        acme_admin.get(&format!("{caches}/sessions")).unwrap()["cache"],
        "sessions"
    );
    assert_eq!(
        acme_admin.get(caches).unwrap()["items"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    let snapshot = admin.get("/v1/streams/snapshot").unwrap();
    assert_eq!(
        (
            snapshot["items"].as_array().unwrap().len(),
            snapshot["caches"].as_array().unwrap().len()
        ),
        (1, 1)
    );
    expect_err(acme_admin.get("/v1/streams/snapshot"), 403);

    // Nodes: a node token may register and heartbeat only itself.
    let node_token = |id: &str| {
        issue(&admin, "operator", json!({"sub": id, "audience": "felix-controlplane", "perms": [format!("node.manage:node:{id}"), "node.view:cluster:*"]})).unwrap()["token"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let node_a = anon.clone().with_token(node_token("node-a"));
    let node_b = anon.clone().with_token(node_token("node-b"));
    let (_, field) = expect_err(
        node_a.post(
            "/v1/nodes",
            &json!({"node_id": "node-a", "client_addr": "nowhere"}),
        ),
        400,
    );
    assert_eq!(field.as_deref(), Some("client_addr"));
    expect_err(
        node_a.post(
            "/v1/nodes",
            &json!({"node_id": "node-b", "client_addr": "127.0.0.1:1"}),
        ),
        403,
    );
    expect_err(
        acme_admin.post("/v1/nodes", &json!({"node_id": "node-a"})),
        403,
    );
    let reg_a = node_a
        .post(
            "/v1/nodes",
            &json!({"node_id": "node-a", "client_addr": "127.0.0.1:5001"}),
        )
        .unwrap();
    assert_eq!(
        (reg_a["incarnation"].as_u64(), reg_a["lifecycle"].as_str()),
        (Some(1), Some("live"))
    );
    assert_eq!(reg_a["heartbeat_interval_ms"], 200);
    assert_eq!(
        (
            reg_a["expiry_timeout_ms"].as_u64(),
            reg_a["regrant_margin_ms"].as_u64()
        ),
        (Some(1000), Some(250))
    );
    node_b
        .post(
            "/v1/nodes",
            &json!({"node_id": "node-b", "client_addr": "127.0.0.1:5002"}),
        )
        .unwrap();
    // Without a client address a node is never assigned anything.
    admin
        .post("/v1/nodes", &json!({"node_id": "node-c"}))
        .unwrap();
    expect_err(
        node_a.post("/v1/nodes/node-a/heartbeat", &json!({"incarnation": 0})),
        409,
    );
    expect_err(
        node_a.post("/v1/nodes/node-b/heartbeat", &json!({"incarnation": 1})),
        403,
    );
    expect_err(
        admin.post("/v1/nodes/node-z/heartbeat", &json!({"incarnation": 1})),
        404,
    );
    let beat = node_a
        .post("/v1/nodes/node-a/heartbeat", &json!({"incarnation": 1}))
        .unwrap();
    assert_eq!(beat["lifecycle"], "live");
    assert_eq!(
        (
            beat["expiry_timeout_ms"].as_u64(),
            beat["regrant_margin_ms"].as_u64()
        ),
        (Some(1000), Some(250))
    );
    assert_eq!(
        node_a.get("/v1/nodes").unwrap()["items"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
    assert_eq!(
        node_a.get("/v1/nodes/node-b").unwrap()["client_addr"],
        "127.0.0.1:5002"
    );
    expect_err(node_a.get("/v1/nodes/node-z"), 404);
    expect_err(acme_admin.get("/v1/nodes"), 403);

    // A second broker under a live node's id is refused while the first may still hold
    // its lease; the same instance registering again (its restart) is a new incarnation;
    // once the first has been silent past the down timeout, the id is free.
    let reg = |instance: &str| {
        admin.post(
            "/v1/nodes",
            &json!({"node_id": "node-c", "instance_id": instance}),
        )
    };
    let first = reg("i-1").unwrap()["incarnation"].as_u64().unwrap();
    let (code, _) = expect_err(reg("i-2"), 409);
    assert_eq!(code.as_deref(), Some("node_id_in_use"));
    // Leaving the instance id out skips nothing.
    let (code, _) = expect_err(
        admin.post(
            "/v1/nodes",
            &json!({"node_id": "node-c", "client_addr": "127.0.0.1:9"}),
        ),
        409,
    );
    assert_eq!(code.as_deref(), Some("node_id_in_use"));
    expect_err(
        admin.post(
            "/v1/nodes",
            &json!({"node_id": "node-c", "instance_id": "i-1", "advertise_addr": "nowhere"}),
        ),
        400,
    );
    assert_eq!(reg("i-1").unwrap()["incarnation"].as_u64(), Some(first + 1));
    assert_eq!(admin.get("/v1/nodes/node-c").unwrap()["instance_id"], "i-1");
    let heard = admin.get("/v1/nodes/node-c").unwrap()["last_heartbeat_ms"]
        .as_u64()
        .unwrap();
    silence(svc, "node-c", heard - 500);
    expect_err(reg("i-2"), 409);
    silence(svc, "node-c", heard - 1300);
    assert_eq!(reg("i-2").unwrap()["incarnation"].as_u64(), Some(first + 2));

    // Placement: 4 + 2 shards over two ready nodes, balanced, never on node-c.
    let snap0 = node_a.get("/v1/shard-assignments/snapshot").unwrap();
    assert!(snap0["items"].as_array().unwrap().is_empty());
    let since = snap0["next_seq"].as_u64().unwrap();
    let report = svc
        .rt
        .block_on(placement::pass(
            svc.store.as_ref(),
            &svc.config,
            &svc.reports,
        ))
        .unwrap();
    assert_eq!((report.created, report.unplaced), (6, 0));
    let again = svc
        .rt
        .block_on(placement::pass(
            svc.store.as_ref(),
            &svc.config,
            &svc.reports,
        ))
        .unwrap();
    assert_eq!(
        again,
        placement::PassReport::default(),
        "a settled cluster writes nothing"
    );
    let assignments: Vec<Assignment> =
        serde_json::from_value(node_a.get("/v1/shard-assignments").unwrap()["items"].clone())
            .unwrap();
    assert_eq!(assignments.len(), 6);
    let per = placement::leaders_per_node(&assignments);
    assert_eq!(per.get("node-a"), Some(&3), "{per:?}");
    assert_eq!(per.get("node-b"), Some(&3), "{per:?}");
    for a in &assignments {
        assert_ne!(a.leader, "node-c");
        let want_replicas = if a.key.kind == "stream" { 2 } else { 1 };
        assert_eq!(a.replicas.len(), want_replicas, "{a:?}");
        assert_eq!(a.generation, 1);
        assert_eq!(
            a.routing.is_some(),
            a.key.kind == "stream",
            "jump_hash travels with stream assignments"
        );
    }
    let changes = node_a
        .get_long(
            &format!("/v1/shard-assignments/changes?since={since}&wait_ms=2000"),
            Duration::from_secs(3),
        )
        .unwrap();
    assert_eq!(changes["items"].as_array().unwrap().len(), 6);
    let head = changes["next_seq"].as_u64().unwrap();
    let t = std::time::Instant::now();
    let idle = node_a
        .get_long(
            &format!("/v1/shard-assignments/changes?since={head}&wait_ms=300"),
            Duration::from_secs(3),
        )
        .unwrap();
    assert!(idle["items"].as_array().unwrap().is_empty());
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "the long poll waited"
    );

    // Moves: unknown destination, already leader, then a real one.
    let orders0 = assignments
        .iter()
        .find(|a| a.key.kind == "stream" && a.key.shard == 0)
        .unwrap();
    let other = if orders0.leader == "node-a" {
        "node-b"
    } else {
        "node-a"
    };
    let mv = |dest: &str| json!({"tenant_id": "acme", "namespace": "payments", "stream": "orders", "shard": 0, "destination": dest});
    expect_err(admin.post("/v1/shard-moves", &mv("node-z")), 409);
    expect_err(admin.post("/v1/shard-moves", &mv("node-c")), 409);
    expect_err(admin.post("/v1/shard-moves", &mv(&orders0.leader)), 409);
    expect_err(node_a.post("/v1/shard-moves", &mv(other)), 403);
    expect_err(admin.post("/v1/shard-moves", &json!({"tenant_id": "acme", "namespace": "payments", "stream": "orders", "shard": 9, "destination": other})), 404);
    // The destination must be live: on a loaded machine the registrations can be more
    // than the 1 s expiry ago by now (CI once refused `destination_not_live`). Every
    // node is heard again at once, so the silences judged below keep their order.
    for n in ["node-a", "node-b", "node-c"] {
        let incarnation = admin.get(&format!("/v1/nodes/{n}")).unwrap()["incarnation"].clone();
        admin
            .post(
                &format!("/v1/nodes/{n}/heartbeat"),
                &json!({ "incarnation": incarnation }),
            )
            .unwrap();
    }
    let moved = admin.post("/v1/shard-moves", &mv(other)).unwrap();
    assert_eq!(
        (
            moved["assignment"]["leader"].as_str(),
            moved["assignment"]["generation"].as_u64()
        ),
        (Some(other), Some(2))
    );
    // A planned handoff: the new leader waits a while for the old one's fence.
    assert_eq!(
        moved["assignment"]["handoff"],
        json!({"from": orders0.leader, "generation": 2})
    );

    // A node that stops heartbeating goes down after the expiry plus the margin; its
    // replicated shards are promoted to the other member, its unreplicated (RF 1,
    // durable) cache shards wait for it.
    std::thread::sleep(Duration::from_millis(300));
    node_a
        .post("/v1/nodes/node-a/heartbeat", &json!({"incarnation": 1}))
        .unwrap();
    let heard = |id: &str| {
        serde_json::from_value::<felix_controlplane::model::Node>(
            node_a.get(&format!("/v1/nodes/{id}")).unwrap(),
        )
        .unwrap()
        .last_heartbeat_ms
    };
    let before: Vec<Assignment> =
        serde_json::from_value(node_a.get("/v1/shard-assignments").unwrap()["items"].clone())
            .unwrap();
    // Past node-b's expiry but inside the margin: nothing happens yet.
    let report = svc
        .rt
        .block_on(placement::pass_at(
            svc.store.as_ref(),
            &svc.config,
            &svc.reports,
            (heard("node-b") + 1100, 0),
        ))
        .unwrap();
    assert_eq!(report, placement::PassReport::default());
    // Judge the pass just inside node-a's expiry (1 s): node-b, silent since it
    // registered earlier, is past its expiry plus the margin (1.25 s).
    let judge = heard("node-a") + 999;
    assert!(judge >= heard("node-b") + 1250);
    let report = svc
        .rt
        .block_on(placement::pass_at(
            svc.store.as_ref(),
            &svc.config,
            &svc.reports,
            (judge, 0),
        ))
        .unwrap();
    assert!(
        report.nodes_down.contains(&"node-b".to_owned()),
        "{report:?}"
    );
    assert!(
        !report.nodes_down.contains(&"node-a".to_owned()),
        "{report:?}"
    );
    let b_caches = before
        .iter()
        .filter(|a| a.key.kind == "cache" && a.leader == "node-b")
        .count();
    assert_eq!(report.waiting_for_owner, b_caches, "{report:?}");
    let assignments: Vec<Assignment> =
        serde_json::from_value(node_a.get("/v1/shard-assignments").unwrap()["items"].clone())
            .unwrap();
    for (was, now) in before.iter().zip(&assignments) {
        assert_eq!(was.key, now.key);
        assert_eq!(was.replicas, now.replicas, "sets are kept: {now:?}");
        if was.leader == "node-a" {
            assert_eq!(was, now, "node-a's shards stay as they were");
        } else if was.key.kind == "stream" {
            assert_eq!(
                (now.leader.as_str(), now.generation),
                ("node-a", was.generation + 1),
                "promoted: {now:?}"
            );
        } else {
            assert_eq!(was, now, "an RF 1 cache shard waits for node-b: {now:?}");
        }
    }
    assert!(assignments.iter().any(|a| a.generation > 1));
    assert_eq!(node_a.get("/v1/nodes/node-b").unwrap()["lifecycle"], "down");
    // A heartbeat never revives a down node; registering again does.
    let (code, _) = expect_err(
        node_b.post("/v1/nodes/node-b/heartbeat", &json!({"incarnation": 1})),
        409,
    );
    assert_eq!(code.as_deref(), Some("conflict"));
    assert_eq!(
        node_b
            .post(
                "/v1/nodes",
                &json!({"node_id": "node-b", "client_addr": "127.0.0.1:5002"})
            )
            .unwrap()["incarnation"],
        2
    );

    // Deleting a node: not while live, not while leading.
    expect_err(admin.delete("/v1/nodes/node-a"), 409);
    expect_err(node_a.delete("/v1/nodes/node-z"), 403);
    expect_err(admin.delete("/v1/nodes/node-z"), 404);

    // Deleting: a namespace with streams and a tenant with namespaces conflict.
    expect_err(
        acme_admin.delete("/v1/tenants/acme/namespaces/payments"),
        409,
    );
    expect_err(admin.delete("/v1/tenants/acme"), 409);
    acme_admin.delete(&format!("{streams}/orders")).unwrap();
    expect_err(acme_admin.delete(&format!("{streams}/orders")), 404);
    acme_admin.delete(&format!("{caches}/sessions")).unwrap();
    let assignments = node_a.get("/v1/shard-assignments").unwrap();
    assert!(
        assignments["items"].as_array().unwrap().is_empty(),
        "deleting cascades to assignments"
    );
    acme_admin
        .delete("/v1/tenants/acme/namespaces/payments")
        .unwrap();
    expect_err(
        acme_admin.delete("/v1/tenants/acme/namespaces/payments"),
        404,
    );
    admin.delete("/v1/tenants/acme").unwrap();
    expect_err(anon.get("/v1/tenants/acme/.well-known/jwks.json"), 404);
    // Tokens of a deleted tenant stop working: its keys went with it.
    expect_err(acme_admin.get("/v1/tenants/acme/namespaces"), 401);
}

/// `POST` that returns the status and JSON body whatever the status (the client
/// keeps only `code`, `message` and `field` of an error).
fn raw_post(url: &str, token: &str, path: &str, body: &Value) -> (u16, Value) {
    use std::io::{Read, Write};
    let host = url.strip_prefix("http://").unwrap();
    let payload = serde_json::to_vec(body).unwrap();
    let mut s = std::net::TcpStream::connect(host).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        payload.len()
    )
    .unwrap();
    s.write_all(&payload).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let status = raw.split(' ').nth(1).unwrap().parse().unwrap();
    let (_, body) = raw.split_once("\r\n\r\n").unwrap();
    (status, serde_json::from_str(body).unwrap())
}

/// Rewrites a node's last heartbeat: the pass judges silence by this stamp, so a test
/// can make a node silent without waiting.
fn silence(svc: &Service, id: &str, heard_ms: u64) {
    svc.rt.block_on(async {
        let d = svc.store.get(Kind::Node, id).await.unwrap().unwrap();
        let mut n: felix_controlplane::model::Node = serde_json::from_value(d.value).unwrap();
        n.last_heartbeat_ms = heard_ms;
        svc.store
            .batch(vec![Op::Put {
                kind: Kind::Node,
                key: id.into(),
                value: serde_json::to_value(&n).unwrap(),
                expect: Expect::Version(d.version),
            }])
            .await
            .unwrap();
    });
}

fn replication_scenario(svc: &Service) {
    let anon = ControlPlaneClient::new(&svc.url, None).unwrap();
    let boot = anon
        .post_with(
            "/internal/bootstrap",
            &json!({}),
            &[("X-Felix-Bootstrap-Token", BOOTSTRAP)],
        )
        .unwrap();
    let admin_token = boot["token"].as_str().unwrap().to_owned();
    let admin = anon.clone().with_token(&admin_token);
    admin
        .post("/v1/tenants", &json!({"tenant_id": "acme"}))
        .unwrap();
    admin
        .post(
            "/v1/tenants/acme/namespaces",
            &json!({"namespace": "payments"}),
        )
        .unwrap();
    let streams = "/v1/tenants/acme/namespaces/payments/streams";
    admin
        .post(streams, &json!({"stream": "orders", "kind": "Stream", "shards": 1, "replication_factor": 3, "consistency": "Quorum"}))
        .unwrap();
    admin
        .post(
            streams,
            &json!({"stream": "ledger", "kind": "Stream", "shards": 1}),
        )
        .unwrap();
    let nodes = ["node-a", "node-b", "node-c", "node-d"];
    let mut tokens = std::collections::BTreeMap::new();
    for (i, id) in nodes.iter().enumerate() {
        let t = admin
            .post("/v1/tenants/operator/tokens", &json!({"sub": id, "audience": "felix-controlplane", "perms": [format!("node.manage:node:{id}"), "node.view:cluster:*"]}))
            .unwrap()["token"]
            .as_str()
            .unwrap()
            .to_owned();
        anon.clone()
            .with_token(&t)
            .post(
                "/v1/nodes",
                &json!({"node_id": id, "client_addr": format!("127.0.0.1:{}", 5100 + i)}),
            )
            .unwrap();
        tokens.insert(*id, t);
    }
    // Stamps are faked on this process's clock (`silence`), so none is an earlier
    // process's: silence counts from them, not from this process's start (the
    // production pass's floor made the restore below depend on how long ago the test
    // binary started).
    let pass = || {
        svc.rt
            .block_on(placement::pass_at(
                svc.store.as_ref(),
                &svc.config,
                &svc.reports,
                (felix_controlplane::api::liveness_ms(), 0),
            ))
            .unwrap()
    };
    assert_eq!(pass().created, 2);
    let get = |name: &str| -> Assignment {
        let items = admin.get("/v1/shard-assignments").unwrap()["items"].clone();
        let all: Vec<Assignment> = serde_json::from_value(items).unwrap();
        all.into_iter().find(|a| a.key.name == name).unwrap()
    };
    let orders = get("orders");
    assert_eq!(orders.replicas.len(), 3);
    let leader = orders.leader.clone();
    // Followers in rendezvous order: the better-ranked one will report behind.
    let (behind, ahead) = (orders.replicas[1].clone(), orders.replicas[2].clone());
    let outsider = *nodes
        .iter()
        .find(|n| !orders.replicas.iter().any(|m| m == *n))
        .unwrap();
    // The unreplicated ledger shard is put on the same leader, so that one failure
    // shows both rules.
    svc.rt.block_on(async {
        let key = "stream/acme/payments/ledger/0";
        let d = svc.store.get(Kind::Assignment, key).await.unwrap().unwrap();
        let mut a: Assignment = serde_json::from_value(d.value).unwrap();
        a.leader = leader.clone();
        a.replicas = vec![leader.clone()];
        svc.store
            .batch(vec![Op::Put {
                kind: Kind::Assignment,
                key: key.into(),
                value: serde_json::to_value(&a).unwrap(),
                expect: Expect::Version(d.version),
            }])
            .await
            .unwrap();
    });

    // Reports: verdicts per shard, 200 only when all were accepted.
    let shard = |name: &str, generation: u64, log_end: u64, followers: Value| {
        json!({"kind": "stream", "tenant_id": "acme", "namespace": "payments", "name": name,
               "shard": 0, "generation": generation, "log_end": log_end, "commit": log_end / 2,
               "followers": followers})
    };
    let report = |from: &str, shards: Vec<Value>| {
        raw_post(
            &svc.url,
            &tokens[from],
            &format!("/v1/nodes/{from}/replica-status"),
            &json!({ "shards": shards }),
        )
    };
    let results = |v: &Value| -> Vec<String> {
        v["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["result"].as_str().unwrap().to_owned())
            .collect()
    };
    let positions = json!([
        {"node_id": behind, "durable_end": 40},
        {"node_id": ahead, "durable_end": 90}
    ]);
    let (code, body) = report(&leader, vec![shard("orders", 1, 100, positions.clone())]);
    assert_eq!((code, results(&body)), (200, vec!["accepted".to_owned()]));
    // Same generation, shorter log: stale. A follower: not_leader. Ahead of the
    // assignment: future_generation. No such shard: unassigned. One refusal makes
    // the whole answer a 409 that still lists every shard.
    let (code, body) = report(
        &leader,
        vec![
            shard("orders", 1, 99, positions.clone()),
            shard("orders", 2, 120, positions.clone()),
            shard("nothing", 1, 1, json!([])),
            shard("ledger", 1, 7, json!([])),
        ],
    );
    assert_eq!(code, 409);
    assert_eq!(body["code"], "conflict");
    assert_eq!(
        results(&body),
        ["stale", "future_generation", "unassigned", "accepted"]
    );
    assert_eq!(body["results"][0]["name"], "orders");
    let (code, body) = report(&behind, vec![shard("orders", 1, 500, json!([]))]);
    assert_eq!((code, results(&body)), (409, vec!["not_leader".to_owned()]));
    // A node reports only as itself; bodies are validated.
    let (code, _) = raw_post(
        &svc.url,
        &tokens[behind.as_str()],
        &format!("/v1/nodes/{leader}/replica-status"),
        &json!({"shards": []}),
    );
    assert_eq!(code, 403);
    let mut bad = shard("orders", 1, 100, json!([]));
    bad["kind"] = json!("table");
    let (code, body) = report(&leader, vec![bad]);
    assert_eq!((code, body["field"].as_str()), (400, Some("shards.kind")));

    // Visibility: positions and under-replication on the list, the snapshot and the
    // replication view.
    let (code, _) = report(
        &leader,
        vec![shard(
            "orders",
            1,
            100,
            json!([
                {"node_id": behind, "durable_end": 40, "halted": true},
                {"node_id": ahead, "durable_end": 90}
            ]),
        )],
    );
    assert_eq!(code, 200);
    let item = |v: &Value, name: &str| -> Value {
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["name"] == name)
            .unwrap()
            .clone()
    };
    let listed = item(&admin.get("/v1/shard-assignments").unwrap(), "orders");
    assert_eq!(
        listed["positions"],
        json!({leader.as_str(): 100, behind.as_str(): 40, ahead.as_str(): 90})
    );
    assert_eq!(
        listed["under_replicated"], true,
        "a halted follower is no redundancy"
    );
    let snap = admin.get("/v1/shard-assignments/snapshot").unwrap();
    assert_eq!(item(&snap, "orders")["under_replicated"], true);
    assert_eq!(item(&snap, "ledger")["under_replicated"], false);
    assert_eq!(
        item(&snap, "ledger")["positions"],
        json!({leader.as_str(): 7})
    );
    let view = admin.get("/v1/placement/replication").unwrap();
    assert_eq!(
        view["items"].as_array().unwrap().len(),
        1,
        "only replicated shards: {view}"
    );
    let v = item(&view, "orders");
    assert_eq!(
        (v["leader"].as_str(), v["generation"].as_u64()),
        (Some(leader.as_str()), Some(1))
    );
    assert_eq!(v["report"]["log_end"], 100);
    let member = |v: &Value, id: &str| -> Value {
        v["members"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["node_id"] == id)
            .unwrap()
            .clone()
    };
    assert_eq!(
        member(&v, &behind),
        json!({"node_id": behind, "leader": false, "ready": true, "position": 40, "halted": true, "rebuilding": false})
    );
    expect_err(
        anon.clone()
            .with_token("x.y.z")
            .get("/v1/placement/replication"),
        401,
    );
    // The follower recovered: the latest report (same generation, same log end, so
    // accepted) names nobody halted. Positions alone now pick the successor.
    let (code, _) = report(&leader, vec![shard("orders", 1, 100, positions.clone())]);
    assert_eq!(code, 200);
    assert_eq!(
        item(&admin.get("/v1/shard-assignments").unwrap(), "orders")["under_replicated"],
        false
    );

    // Abandon refuses while the owner may still hold its lease, and needs the cluster
    // permission.
    let ledger_key = json!({"kind": "stream", "tenant_id": "acme", "namespace": "payments", "name": "ledger", "shard": 0});
    let (code, _) = expect_err(admin.post("/v1/placement/abandon", &ledger_key), 409);
    assert_eq!(code.as_deref(), Some("conflict"));
    expect_err(
        anon.clone()
            .with_token(&tokens[leader.as_str()])
            .post("/v1/placement/abandon", &ledger_key),
        403,
    );

    // The leader goes quiet. Past its expiry but inside the margin it keeps both
    // shards; past expiry + margin the furthest-ahead member takes orders
    // (set kept, generation + 1) and the RF 1 ledger waits for its owner.
    for n in nodes.iter().filter(|n| **n != leader) {
        anon.clone()
            .with_token(&tokens[n])
            .post(
                &format!("/v1/nodes/{n}/heartbeat"),
                &json!({"incarnation": 1}),
            )
            .unwrap();
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let pass_at = |at: u64| {
        svc.rt
            .block_on(placement::pass_at(
                svc.store.as_ref(),
                &svc.config,
                &svc.reports,
                (at, 0),
            ))
            .unwrap()
    };
    silence(svc, &leader, now - 1150);
    let r = pass_at(now);
    assert_eq!(r, placement::PassReport::default(), "inside the margin");
    assert_eq!(get("orders").leader, leader);
    silence(svc, &leader, now - 10_000);
    let r = pass_at(now);
    assert_eq!(r.nodes_down, std::slice::from_ref(&leader));
    assert_eq!((r.moved, r.waiting_for_owner), (1, 1), "{r:?}");
    let promoted = get("orders");
    assert_eq!(
        promoted.leader, ahead,
        "furthest ahead, not best-ranked ({behind})"
    );
    assert_eq!(promoted.replicas, orders.replicas, "the set is kept");
    assert_eq!(promoted.generation, 2);
    let ledger = get("ledger");
    assert_eq!(
        (ledger.leader.as_str(), ledger.generation),
        (leader.as_str(), 1)
    );

    // The old leader's word no longer counts; the new one's does.
    let (code, body) = report(&leader, vec![shard("orders", 1, 200, json!([]))]);
    assert_eq!((code, results(&body)), (409, vec!["stale".to_owned()]));
    let (code, _) = report(
        &ahead,
        vec![shard(
            "orders",
            2,
            100,
            json!([{"node_id": behind, "durable_end": 100}]),
        )],
    );
    assert_eq!(code, 200);
    // The dead old leader has now been silent past expiry + replica_restore_after:
    // the next passes replace it by the one ready non-member, through a staged copy:
    // staged (same generation), joined once reported caught up, then the dead member
    // retired once the leader reports its generation committed.
    for n in nodes.iter().filter(|n| **n != leader) {
        anon.clone()
            .with_token(&tokens[n])
            .post(
                &format!("/v1/nodes/{n}/heartbeat"),
                &json!({"incarnation": 1}),
            )
            .unwrap();
    }
    let r = pass();
    assert_eq!((r.restored, r.moved), (1, 0), "{r:?}");
    let staged = get("orders");
    assert_eq!(
        (
            staged.replicas.as_slice(),
            staged.staging.as_deref(),
            staged.replaces.as_deref(),
            staged.generation
        ),
        (
            orders.replicas.as_slice(),
            Some(outsider),
            Some(leader.as_str()),
            2
        )
    );
    // Near the end (not at it), the copy joins once generation 2 committed on the set
    // it has.
    let mut caught_up = shard(
        "orders",
        2,
        100,
        json!([{"node_id": behind, "durable_end": 100},
               {"node_id": outsider, "durable_end": 95, "staged": true}]),
    );
    let (code, _) = report(&ahead, vec![caught_up.clone()]);
    assert_eq!(code, 200);
    pass();
    assert_eq!(get("orders").generation, 2, "not before it committed");
    caught_up["generation_committed"] = json!(true);
    let (code, _) = report(&ahead, vec![caught_up]);
    assert_eq!(code, 200);
    pass();
    let joined = get("orders");
    let mut enlarged = orders.replicas.clone();
    enlarged.push(outsider.to_owned());
    assert_eq!(
        (
            &joined.replicas,
            joined.retiring.as_deref(),
            joined.generation
        ),
        (&enlarged, Some(leader.as_str()), 3)
    );
    let mut committed = shard(
        "orders",
        3,
        101,
        json!([{"node_id": behind, "durable_end": 101},
               {"node_id": outsider, "durable_end": 101}]),
    );
    committed["generation_committed"] = json!(true);
    let (code, _) = report(&ahead, vec![committed]);
    assert_eq!(code, 200);
    pass();
    let restored = get("orders");
    let want: Vec<String> = enlarged.into_iter().filter(|n| *n != leader).collect();
    assert_eq!(
        (
            restored.leader.as_str(),
            &restored.replicas,
            restored.generation
        ),
        (ahead.as_str(), &want, 4)
    );

    // A drain in the middle of a restore or move hands leadership to a member that is
    // not retiring (the retiring one would be removed from its own set while leading),
    // and abandons a staged copy.
    let key = restored.key.store_key();
    let doc = svc
        .rt
        .block_on(svc.store.get(Kind::Assignment, &key))
        .unwrap()
        .unwrap();
    let mut mid = restored.clone();
    mid.retiring = Some(behind.clone());
    mid.staging = Some(leader.clone());
    mid.replaces = Some(ahead.clone());
    svc.rt
        .block_on(svc.store.batch(vec![Op::Put {
            kind: Kind::Assignment,
            key,
            value: serde_json::to_value(&mid).unwrap(),
            expect: Expect::Version(doc.version),
        }]))
        .unwrap();
    let (code, body) = raw_post(
        &svc.url,
        &tokens[ahead.as_str()],
        &format!("/v1/nodes/{ahead}/drain"),
        &json!({}),
    );
    assert_eq!(code, 200, "{body}");
    let drained = get("orders");
    assert_eq!(
        (
            drained.leader.as_str(),
            drained.retiring.as_deref(),
            drained.staging,
            drained.replaces
        ),
        (outsider, Some(behind.as_str()), None, None),
        "{body}"
    );
    assert_eq!(
        drained.handoff,
        Some(Handoff {
            from: ahead.clone(),
            generation: drained.generation
        })
    );

    // Abandoning the waiting ledger moves it to a ready node and says data was lost;
    // orders has a serving leader and cannot be abandoned. A copy it was staging (a
    // restore the leader died before) goes with the old set.
    svc.rt.block_on(async {
        let key = "stream/acme/payments/ledger/0";
        let d = svc.store.get(Kind::Assignment, key).await.unwrap().unwrap();
        let mut a: Assignment = serde_json::from_value(d.value).unwrap();
        a.staging = Some(outsider.to_owned());
        a.replaces = Some(leader.clone());
        a.retiring = Some(leader.clone());
        svc.store
            .batch(vec![Op::Put {
                kind: Kind::Assignment,
                key: key.into(),
                value: serde_json::to_value(&a).unwrap(),
                expect: Expect::Version(d.version),
            }])
            .await
            .unwrap();
    });
    let answer = admin.post("/v1/placement/abandon", &ledger_key).unwrap();
    assert_eq!(answer["lost_data"], true);
    assert_eq!(answer["previous_leader"], leader.as_str());
    let moved: Assignment = serde_json::from_value(answer["assignment"].clone()).unwrap();
    assert_ne!(moved.leader, leader);
    assert_eq!(moved.replicas, std::slice::from_ref(&moved.leader));
    assert_eq!(moved.generation, 2);
    // Marked, so brokers keep what the old owner left for a manual recovery.
    assert_eq!(moved.abandoned, Some(2));
    assert_eq!(
        (&moved.staging, &moved.replaces, &moved.retiring),
        (&None, &None, &None)
    );
    assert_eq!(get("ledger"), moved);
    let mut orders_key = ledger_key.clone();
    orders_key["name"] = json!("orders");
    expect_err(admin.post("/v1/placement/abandon", &orders_key), 409);
    let mut nothing = ledger_key.clone();
    nothing["name"] = json!("nothing");
    expect_err(admin.post("/v1/placement/abandon", &nothing), 404);
    assert_eq!(pass().waiting_for_owner, 0);
}

#[test]
fn replication_against_the_memory_store() {
    replication_scenario(&memory_service());
}

#[test]
fn replication_against_postgres() {
    replication_scenario(&postgres_service());
}

#[test]
fn api_against_the_memory_store() {
    scenario(&memory_service());
}

#[test]
fn api_against_postgres() {
    scenario(&postgres_service());
}

#[test]
fn postgres_keeps_metadata_across_restarts() {
    let svc = postgres_service();
    let anon = ControlPlaneClient::new(&svc.url, None).unwrap();
    let boot = anon
        .post_with(
            "/internal/bootstrap",
            &json!({}),
            &[("X-Felix-Bootstrap-Token", BOOTSTRAP)],
        )
        .unwrap();
    let admin = anon.clone().with_token(boot["token"].as_str().unwrap());
    admin
        .post("/v1/tenants", &json!({"tenant_id": "acme"}))
        .unwrap();
    // A second service over the same database sees it and accepts the same token.
    let again = start(svc.store.clone(), runtime());
    let admin2 =
        ControlPlaneClient::new(&again.url, Some(boot["token"].as_str().unwrap().to_owned()))
            .unwrap();
    assert_eq!(
        admin2.get("/v1/tenants").unwrap()["items"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    expect_err(
        admin2.post("/v1/tenants", &json!({"tenant_id": "acme"})),
        409,
    );
}

#[test]
fn concurrent_creates_of_one_name_admit_exactly_one() {
    for svc in [memory_service(), postgres_service()] {
        let anon = ControlPlaneClient::new(&svc.url, None).unwrap();
        let boot = anon
            .post_with(
                "/internal/bootstrap",
                &json!({}),
                &[("X-Felix-Bootstrap-Token", BOOTSTRAP)],
            )
            .unwrap();
        let admin = anon.with_token(boot["token"].as_str().unwrap());
        taken_at_once(1, |_| {
            admin.post("/v1/tenants", &json!({"tenant_id": "race"}))
        });
    }
}

/// `n` control planes over one store, twice: over one memory store shared, then over
/// one Postgres database through a connection each. A control plane's counted writes
/// take turns; those of different control planes race over the fence.
fn control_planes(n: usize) -> [Vec<Service>; 2] {
    let memory: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let (url, _) = fresh_database();
    [
        (0..n).map(|_| start(memory.clone(), runtime())).collect(),
        (0..n)
            .map(|_| {
                let rt = runtime();
                start(Arc::new(postgres_store_at(&url, &rt)), rt)
            })
            .collect(),
    ]
}

/// An operator client of each of `services` (bootstrapped through the first).
fn admins_of(services: &[&Service]) -> Vec<ControlPlaneClient> {
    let token = operator_token(services[0]);
    services
        .iter()
        .map(|svc| ControlPlaneClient::new(&svc.url, Some(token.clone())).unwrap())
        .collect()
}

/// The HTTP statuses of `post(i)` for `i` in 0..n, sent at once from `n` threads.
fn statuses_at_once(
    n: usize,
    post: impl Fn(usize) -> Result<Value, ClientError> + Sync,
) -> Vec<u16> {
    let post = &post;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n).map(|i| s.spawn(move || status(post(i)).0)).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Tenant `acme` with namespaces `ns0` to `ns{n-1}`, made by `admin`.
fn acme_with_namespaces(admin: &ControlPlaneClient, n: usize) {
    admin
        .post("/v1/tenants", &json!({"tenant_id": "acme"}))
        .unwrap();
    for i in 0..n {
        admin
            .post(
                "/v1/tenants/acme/namespaces",
                &json!({"namespace": format!("ns{i}")}),
            )
            .unwrap();
    }
}

/// Sends `post(i)` for `i` in 0..8 at once, from eight threads: exactly `taken` are
/// taken and the others refused 409.
fn taken_at_once(taken: usize, post: impl Fn(usize) -> Result<Value, ClientError> + Sync) {
    let results = statuses_at_once(8, post);
    assert_eq!(
        results.iter().filter(|s| **s == 200).count(),
        taken,
        "{results:?}"
    );
    assert!(
        results.iter().all(|s| *s == 200 || *s == 409),
        "{results:?}"
    );
}

#[test]
fn openapi_describes_every_route() {
    let source = include_str!("../src/api.rs");
    let shape = |p: &str| {
        let mut out = String::new();
        let mut depth = 0;
        for c in p.chars() {
            match c {
                '{' => {
                    depth += 1;
                    out.push_str("{}");
                }
                '}' => depth -= 1,
                _ if depth == 0 => out.push(c),
                _ => {}
            }
        }
        out
    };
    let mut routes: Vec<String> = source
        .split(".route(")
        .skip(1)
        .filter_map(|r| {
            r.trim_start()
                .strip_prefix('"')?
                .split('"')
                .next()
                .map(shape)
        })
        .collect();
    routes.sort();
    let doc: Value = serde_json::from_str(include_str!("../openapi.json")).unwrap();
    let mut documented: Vec<String> = doc["paths"]
        .as_object()
        .unwrap()
        .keys()
        .map(|p| shape(p))
        .collect();
    documented.sort();
    assert_eq!(routes, documented);
}

/// This package's directory: cargo's value at run time (a build reused from another
/// checkout must not read that checkout's files), the compile-time one otherwise.
fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
        || env!("CARGO_MANIFEST_DIR").into(),
        std::path::PathBuf::from,
    )
}

/// Rotation, retirement, revocation by token id, the audit log, and keys sealed at rest.
fn key_lifecycle_scenario(svc: &Service) {
    let (anon, admin) = bootstrapped(svc);
    admin
        .post("/v1/tenants", &json!({"tenant_id": "acme"}))
        .unwrap();
    let issue = |perms: Value| {
        admin
            .post(
                "/v1/tenants/acme/tokens",
                &json!({"sub": "alice", "audience": "felix-controlplane", "perms": perms}),
            )
            .unwrap()
    };
    let first = issue(json!(["tenant.manage:tenant:acme"]));
    let acme = anon.clone().with_token(first["token"].as_str().unwrap());
    let old_kid = first["kid"].as_str().unwrap().to_owned();
    assert_eq!(first["jti"].as_str().unwrap().len(), 32);

    // The store holds no usable private key: the row has the public key and a sealed
    // blob, no PKCS#8, and the blob opens with no other KEK.
    let rows = svc
        .rt
        .block_on(svc.store.list(Kind::SigningKey, "acme/"))
        .unwrap();
    assert_eq!(rows.len(), 1);
    let row = &rows[0].value;
    assert!(row.get("pkcs8").is_none(), "{row}");
    assert_eq!(row["sealed"]["kek"].as_str().unwrap().len(), 16);
    let sealed: felix_controlplane::sealing::Sealed =
        serde_json::from_value(row["sealed"].clone()).unwrap();
    let key_row = format!("acme/{old_kid}");
    let opened = felix_controlplane::sealing::Keyring::new(&TEST_KEK, &[])
        .open(&key_row, &sealed)
        .unwrap();
    assert!(felix_wire::token::SigningKey::from_pkcs8(&opened, &old_kid).is_ok());
    assert!(
        felix_controlplane::sealing::Keyring::new(&[1; 32], &[])
            .open(&key_row, &sealed)
            .is_err(),
        "another KEK does not open it"
    );
    let text = row.to_string();
    let b64 = |b: &[u8]| {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(b)
    };
    assert!(
        !text.contains(&b64(&opened)),
        "the clear key is not in the row"
    );

    // Stage a key: listed, in the JWKS, not yet signing.
    let staged = acme
        .post("/v1/tenants/acme/signing-keys", &json!({}))
        .unwrap();
    let new_kid = staged["kid"].as_str().unwrap().to_owned();
    assert_eq!(staged["active"], false);
    let listed = acme.get("/v1/tenants/acme/signing-keys").unwrap();
    let items = listed["items"].as_array().unwrap();
    assert_eq!(items.len(), 2);
    assert!(
        items
            .iter()
            .all(|k| k.get("pkcs8").is_none() && k.get("sealed").is_none())
    );
    let jwks = anon.get("/v1/tenants/acme/.well-known/jwks.json").unwrap();
    assert_eq!(jwks["keys"].as_array().unwrap().len(), 2);
    assert_eq!(issue(json!([]))["kid"], old_kid.as_str());
    // The active key cannot be retired; an unknown one is 404.
    expect_err(
        acme.delete(&format!("/v1/tenants/acme/signing-keys/{old_kid}")),
        409,
    );
    expect_err(
        acme.post("/v1/tenants/acme/signing-keys/nope/activate", &json!({})),
        404,
    );
    // Another tenant's admin cannot touch acme's keys.
    admin
        .post("/v1/tenants", &json!({"tenant_id": "globex"}))
        .unwrap();
    let globex = anon.clone().with_token(
        admin
            .post(
                "/v1/tenants/globex/tokens",
                &json!({"sub": "g", "audience": "felix-controlplane", "perms": ["tenant.manage:tenant:globex"]}),
            )
            .unwrap()["token"]
            .as_str()
            .unwrap(),
    );
    expect_err(globex.get("/v1/tenants/acme/signing-keys"), 403);
    expect_err(
        globex.post("/v1/tenants/acme/signing-keys", &json!({})),
        403,
    );

    // Activate the new one: new tokens carry its kid; old tokens still verify.
    acme.post(
        &format!("/v1/tenants/acme/signing-keys/{new_kid}/activate"),
        &json!({}),
    )
    .unwrap();
    let second = issue(json!(["tenant.manage:tenant:acme"]));
    assert_eq!(second["kid"], new_kid.as_str());
    let acme2 = anon.clone().with_token(second["token"].as_str().unwrap());
    acme.get("/v1/tenants/acme/signing-keys").unwrap();
    // Retire the old key: tokens it signed stop working; the JWKS drops it.
    acme2
        .delete(&format!("/v1/tenants/acme/signing-keys/{old_kid}"))
        .unwrap();
    expect_err(acme.get("/v1/tenants/acme/signing-keys"), 401);
    let jwks = anon.get("/v1/tenants/acme/.well-known/jwks.json").unwrap();
    assert_eq!(jwks["keys"].as_array().unwrap().len(), 1);
    assert_eq!(jwks["keys"][0]["kid"], new_kid.as_str());

    // Deny one token by id: refused at once; the other token of the key still works.
    let third = issue(json!(["tenant.manage:tenant:acme"]));
    let acme3 = anon.clone().with_token(third["token"].as_str().unwrap());
    acme3.get("/v1/tenants/acme/signing-keys").unwrap();
    let (_, field) = expect_err(
        acme2.post(
            "/v1/tenants/acme/token-denials",
            &json!({"jti": "bad jti!"}),
        ),
        400,
    );
    assert_eq!(field.as_deref(), Some("jti"));
    acme2
        .post(
            "/v1/tenants/acme/token-denials",
            &json!({"jti": third["jti"], "reason": "leaked in a log"}),
        )
        .unwrap();
    let (code, _) = expect_err(acme3.get("/v1/tenants/acme/signing-keys"), 401);
    assert_eq!(code.as_deref(), Some("unauthenticated"));
    acme2.get("/v1/tenants/acme/signing-keys").unwrap();
    let denials = admin.get("/v1/token-denials").unwrap();
    assert_eq!(denials["items"][0]["jti"], third["jti"]);
    expect_err(acme2.get("/v1/token-denials"), 403);
    assert_eq!(
        acme2.get("/v1/tenants/acme/token-denials").unwrap()["items"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    // A write carrying a bootstrap header it has no use for is still alice's.
    acme2
        .post_with(
            "/v1/tenants/acme/namespaces",
            &json!({"namespace": "spoofed"}),
            &[("X-Felix-Bootstrap-Token", "anything")],
        )
        .unwrap();
    // The audit log: every write, who and with what outcome, none of the reads.
    let log = admin.get("/v1/audit").unwrap();
    let entries = log["items"].as_array().unwrap();
    let line = |e: &Value| {
        format!(
            "{} {} {} {}",
            e["principal"].as_str().unwrap(),
            e["method"].as_str().unwrap(),
            e["path"].as_str().unwrap(),
            e["status"]
        )
    };
    let lines: Vec<String> = entries.iter().map(line).collect();
    let has = |want: &str| lines.iter().any(|l| l == want);
    assert!(has("bootstrap POST /internal/bootstrap 200"), "{lines:#?}");
    assert!(
        has("alice POST /v1/tenants/acme/namespaces 201"),
        "a bootstrap header relabelled the write: {lines:#?}"
    );
    assert!(has("operator-admin POST /v1/tenants 201"), "{lines:#?}");
    assert!(
        has("alice POST /v1/tenants/acme/signing-keys 201"),
        "{lines:#?}"
    );
    assert!(
        has(&format!(
            "alice DELETE /v1/tenants/acme/signing-keys/{old_kid} 409"
        )),
        "{lines:#?}"
    );
    assert!(
        has(&format!(
            "alice DELETE /v1/tenants/acme/signing-keys/{old_kid} 204"
        )),
        "{lines:#?}"
    );
    assert!(
        has("g POST /v1/tenants/acme/signing-keys 403"),
        "{lines:#?}"
    );
    assert!(
        has("alice POST /v1/tenants/acme/token-denials 201"),
        "{lines:#?}"
    );
    assert!(
        !lines.iter().any(|l| l.contains(" GET ")),
        "reads are not audited"
    );
    let times: Vec<u64> = entries
        .iter()
        .map(|e| e["at_ms"].as_u64().unwrap())
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "oldest first");
    // A tenant sees its own entries only; paging continues where a page ended.
    // (Another tenant's refused writes to acme's paths named globex and its principal
    // in acme's view, until 2026-12-07.)
    let own = acme2.get("/v1/tenants/acme/audit").unwrap();
    let own = own["items"].as_array().unwrap();
    assert!(own.iter().all(|e| e["tenant"] != "globex"), "{own:#?}");
    let own: Vec<String> = own.iter().map(line).collect();
    assert!(
        !own.contains(&"g POST /v1/tenants/acme/signing-keys 403".to_owned()),
        "{own:#?}"
    );
    assert!(own.iter().any(|l| l.contains("token-denials")));
    expect_err(acme2.get("/v1/audit"), 403);
    expect_err(globex.get("/v1/tenants/acme/audit"), 403);
    let page = admin.get("/v1/audit?limit=2").unwrap();
    assert_eq!(page["items"].as_array().unwrap().len(), 2);
    assert!(page["next_since_ms"].as_u64().is_some());
    // The next page starts after the last entry given, by its id.
    let after = page["next_after"].as_str().unwrap();
    assert_eq!(page["items"][1]["id"], after);
    let next = admin
        .get(&format!("/v1/audit?limit=2&after={after}"))
        .unwrap();
    assert_eq!(next["items"][0], entries[2], "{next:#?}");
}

#[test]
fn signing_keys_rotate_retire_and_revoke_against_the_memory_store() {
    key_lifecycle_scenario(&memory_service());
}

#[test]
fn signing_keys_rotate_retire_and_revoke_against_postgres() {
    key_lifecycle_scenario(&postgres_service());
}

/// A tenant's key set stays one brokers take: at most 64 keys (brokers refuse a larger
/// set and keep the tenant's last one, so a tenant admin staging 64 keys froze the
/// brokers' copy and no retirement reached them), and key ids of at most 128 bytes
/// whatever the tenant id's length (a 128-character tenant's ids were refused by every
/// broker from its creation).
#[test]
fn a_tenants_key_set_stays_one_brokers_accept() {
    let svc = memory_service();
    let (anon, admin) = bootstrapped(&svc);
    admin
        .post("/v1/tenants", &json!({"tenant_id": "acme"}))
        .unwrap();
    for _ in 1..64 {
        admin
            .post("/v1/tenants/acme/signing-keys", &json!({}))
            .unwrap();
    }
    expect_err(admin.post("/v1/tenants/acme/signing-keys", &json!({})), 409);
    let jwks = anon.get("/v1/tenants/acme/.well-known/jwks.json").unwrap();
    assert_eq!(jwks["keys"].as_array().unwrap().len(), 64);
    // Retiring one makes room again.
    let kid = jwks["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["kid"].as_str().unwrap().to_owned())
        .find(|kid| {
            admin
                .delete(&format!("/v1/tenants/acme/signing-keys/{kid}"))
                .is_ok()
        });
    assert!(kid.is_some(), "an inactive key retires");
    admin
        .post("/v1/tenants/acme/signing-keys", &json!({}))
        .unwrap();

    let long = "t".repeat(128);
    admin
        .post("/v1/tenants", &json!({"tenant_id": long}))
        .unwrap();
    admin
        .post(&format!("/v1/tenants/{long}/signing-keys"), &json!({}))
        .unwrap();
    let jwks = anon
        .get(&format!("/v1/tenants/{long}/.well-known/jwks.json"))
        .unwrap();
    let kids: Vec<&str> = jwks["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["kid"].as_str().unwrap())
        .collect();
    assert_eq!(kids.len(), 2);
    assert!(kids.iter().all(|k| k.len() <= 128), "{kids:?}");
}

/// A write to a tenant's path written with escapes (`%61cme` for acme) is in that
/// tenant's audit log: the filter compared the raw path with the decoded name.
#[test]
fn a_write_to_an_escaped_tenant_path_is_in_the_tenants_audit_log() {
    let svc = memory_service();
    let (_anon, admin) = bootstrapped(&svc);
    admin
        .post("/v1/tenants", &json!({"tenant_id": "acme"}))
        .unwrap();
    let staged = admin
        .post("/v1/tenants/%61cme/signing-keys", &json!({}))
        .unwrap();
    let kid = staged["kid"].as_str().unwrap();
    assert!(kid.starts_with("acme-"), "{kid}");
    let audit = admin.get("/v1/tenants/acme/audit").unwrap();
    let paths: Vec<&str> = audit["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    assert!(
        paths.contains(&"/v1/tenants/acme/signing-keys"),
        "{paths:?}"
    );
}

/// Three holes an audit found: the operator tenant could be deleted (its keys sign
/// every operator and node token: the cluster locked out for good); a write to a
/// stream (or tenant, namespace, cache) named `heartbeat` was taken for a node's
/// heartbeat and not audited; and a denial lapsed at its `until`, while a token is
/// accepted up to a minute past its `exp`, so one denied until its expiry verified again
/// for that minute.
#[test]
fn the_operator_tenant_stays_writes_named_like_heartbeats_are_audited_and_denials_cover_the_skew() {
    let svc = memory_service();
    let (anon, admin) = bootstrapped(&svc);
    expect_err(admin.delete("/v1/tenants/operator"), 409);
    // Its keys still sign: the operator's token works on.

    admin
        .post("/v1/tenants", &json!({"tenant_id": "acme"}))
        .unwrap();
    admin
        .post("/v1/tenants/acme/namespaces", &json!({"namespace": "ns"}))
        .unwrap();
    let streams = "/v1/tenants/acme/namespaces/ns/streams";
    admin
        .post(
            streams,
            &json!({"stream": "heartbeat", "kind": "Stream", "shards": 1, "replication_factor": 1}),
        )
        .unwrap();
    admin.delete(&format!("{streams}/heartbeat")).unwrap();
    let audit = admin.get("/v1/tenants/acme/audit").unwrap();
    let deleted =
        audit["items"].as_array().unwrap().iter().any(|e| {
            e["method"] == "DELETE" && e["path"] == format!("{streams}/heartbeat").as_str()
        });
    assert!(deleted, "{audit:#}");
    // A node's deletion whose encoded name decodes to a heartbeat's shape is audited
    // too (the router matched the raw path).
    let _ = admin.delete("/v1/nodes/x%2Fheartbeat");
    let all = admin.get("/v1/audit").unwrap();
    let audited = all["items"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["method"] == "DELETE" && e["path"] == "/v1/nodes/x/heartbeat");
    assert!(audited, "{all:#}");

    let token = admin
        .post(
            "/v1/tenants/acme/tokens",
            &json!({"sub": "bob", "audience": "felix-controlplane", "perms": ["tenant.manage:tenant:acme"]}),
        )
        .unwrap();
    let bob = anon.clone().with_token(token["token"].as_str().unwrap());
    bob.get("/v1/tenants/acme/signing-keys").unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // Denied until 30 s ago: within the minute a token outlives its `exp`.
    admin
        .post(
            "/v1/tenants/acme/token-denials",
            &json!({"jti": token["jti"], "until": now - 30}),
        )
        .unwrap();
    expect_err(bob.get("/v1/tenants/acme/signing-keys"), 401);
    let live = admin.get("/v1/token-denials").unwrap();
    assert_eq!(live["items"][0]["jti"], token["jti"], "{live:#}");
}

/// Writes nobody could make are not audited: a request no route takes, or one refused
/// 401. Anyone could add entries without end (each a store write taking every writer's
/// lock); a forbidden write by a caller with a token still is.
#[test]
fn anonymous_writes_do_not_fill_the_audit_log() {
    let svc = memory_service();
    let (anon, admin) = bootstrapped(&svc);
    let before = admin.get("/v1/audit").unwrap()["items"]
        .as_array()
        .unwrap()
        .len();
    let forged = anon.clone().with_token("e30.e30.e30");
    for _ in 0..50 {
        expect_err(anon.post("/v1/nope", &json!({})), 404);
        expect_err(anon.post("/v1/tenants", &json!({"tenant_id": "x"})), 401);
        expect_err(anon.delete("/v1/tenants"), 405);
        expect_err(forged.post("/v1/tenants", &json!({"tenant_id": 7})), 401);
        // A bootstrap call with a wrong secret is labelled the bootstrap's by its header.
        expect_err(
            anon.post_with(
                "/internal/bootstrap",
                &json!({}),
                &[("X-Felix-Bootstrap-Token", "wrong")],
            ),
            401,
        );
    }
    let long = format!("/v1/tenants/{}", "a".repeat(5_000));
    let _ = admin.delete(&long);
    let entries = admin.get("/v1/audit").unwrap()["items"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(entries.len(), before + 1, "{entries:#?}");
    let path = entries.last().unwrap()["path"].as_str().unwrap();
    assert!(path.chars().count() <= 1025, "{} characters", path.len());
    // A tenant's token on a refused bootstrap call (done already) is recorded as the
    // tenant's, not the operator's (whose entries are never pruned): a tenant could
    // otherwise grow the log past its own bound.
    admin
        .post("/v1/tenants", &json!({"tenant_id": "acme"}))
        .unwrap();
    let acme = anon.clone().with_token(
        admin
            .post(
                "/v1/tenants/acme/tokens",
                &json!({"sub": "mallory", "audience": "felix-controlplane",
                        "perms": ["tenant.manage:tenant:acme"]}),
            )
            .unwrap()["token"]
            .as_str()
            .unwrap(),
    );
    expect_err(
        acme.post_with(
            "/internal/bootstrap",
            &json!({}),
            &[("X-Felix-Bootstrap-Token", BOOTSTRAP)],
        ),
        409,
    );
    let entries = admin.get("/v1/audit").unwrap()["items"]
        .as_array()
        .unwrap()
        .clone();
    // (Found by its status: entries of one millisecond come in no set order.)
    let refused: Vec<&Value> = entries
        .iter()
        .filter(|e| e["path"] == "/internal/bootstrap" && e["status"] == 409)
        .collect();
    assert_eq!(refused.len(), 1, "{entries:#?}");
    assert_eq!(refused[0]["tenant"], "acme", "{}", refused[0]);
    assert_eq!(refused[0]["principal"], "mallory", "{}", refused[0]);
}

#[test]
fn keys_stored_in_clear_or_under_an_old_kek_are_sealed_again_at_start() {
    let rt = runtime();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    // A row as versions before sealing wrote it.
    let legacy = felix_wire::token::SigningKey::generate("acme-old").unwrap();
    let clear = {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(legacy.pkcs8())
    };
    rt.block_on(store.batch(vec![
        Op::Put {
            kind: Kind::Tenant,
            key: "acme".into(),
            value: json!({"tenant_id": "acme"}),
            expect: Expect::Absent,
        },
        Op::Put {
            kind: Kind::SigningKey,
            key: "acme/acme-old".into(),
            value: json!({"kid": "acme-old", "pkcs8": clear, "active": true}),
            expect: Expect::Absent,
        },
    ]))
    .unwrap();
    let old = felix_controlplane::sealing::Keyring::new(&[5; 32], &[]);
    let n = rt
        .block_on(felix_controlplane::api::reseal_keys(store.as_ref(), &old))
        .unwrap();
    assert_eq!(n, 1);
    let row = rt
        .block_on(store.get(Kind::SigningKey, "acme/acme-old"))
        .unwrap()
        .unwrap();
    assert!(row.value.get("pkcs8").is_none(), "{}", row.value);
    assert_eq!(row.value["sealed"]["kek"], old.current_id());
    // Rotation: the new KEK current, the old one previous: sealed again, opens only
    // with the new one afterwards.
    let new = felix_controlplane::sealing::Keyring::new(&[6; 32], &[[5; 32]]);
    assert_eq!(
        rt.block_on(felix_controlplane::api::reseal_keys(store.as_ref(), &new))
            .unwrap(),
        1
    );
    assert_eq!(
        rt.block_on(felix_controlplane::api::reseal_keys(store.as_ref(), &new))
            .unwrap(),
        0
    );
    let row = rt
        .block_on(store.get(Kind::SigningKey, "acme/acme-old"))
        .unwrap()
        .unwrap();
    let sealed: felix_controlplane::sealing::Sealed =
        serde_json::from_value(row.value["sealed"].clone()).unwrap();
    assert_eq!(
        felix_controlplane::sealing::Keyring::new(&[6; 32], &[])
            .open("acme/acme-old", &sealed)
            .unwrap(),
        legacy.pkcs8()
    );
    // Without the KEK that sealed it, start refuses and names the KEK.
    let lost = felix_controlplane::sealing::Keyring::new(&[7; 32], &[]);
    let e = rt
        .block_on(felix_controlplane::api::reseal_keys(store.as_ref(), &lost))
        .unwrap_err();
    assert!(e.to_string().contains(new.current_id()), "{e}");
}

/// An anonymous client of `svc` and one holding the bootstrap admin token.
fn bootstrapped(svc: &Service) -> (ControlPlaneClient, ControlPlaneClient) {
    let anon = ControlPlaneClient::new(&svc.url, None).unwrap();
    let admin = anon.clone().with_token(operator_token(svc));
    (anon, admin)
}

/// Bootstraps `svc` and returns the operator token it answers.
fn operator_token(svc: &Service) -> String {
    let boot = ControlPlaneClient::new(&svc.url, None)
        .unwrap()
        .post_with(
            "/internal/bootstrap",
            &json!({}),
            &[("X-Felix-Bootstrap-Token", BOOTSTRAP)],
        )
        .unwrap();
    boot["token"].as_str().unwrap().to_owned()
}

/// Node `id` registered live with client port `port`: a client holding its node token.
fn registered_node(
    anon: &ControlPlaneClient,
    admin: &ControlPlaneClient,
    id: &str,
    port: u16,
) -> ControlPlaneClient {
    let token = admin
        .post(
            "/v1/tenants/operator/tokens",
            &json!({"sub": id, "audience": "felix-controlplane",
                    "perms": [format!("node.manage:node:{id}"), "node.view:cluster:*"]}),
        )
        .unwrap()["token"]
        .as_str()
        .unwrap()
        .to_owned();
    let node = anon.clone().with_token(&token);
    node.post(
        "/v1/nodes",
        &json!({"node_id": id, "client_addr": format!("127.0.0.1:{port}")}),
    )
    .unwrap();
    node
}

/// A store that runs a write of its own just before the next batch putting a document
/// of the armed kind: a write racing a handler between its read and its write, made
/// deterministic.
#[derive(Debug, Default)]
struct RacingStore {
    inner: MemoryStore,
    race: std::sync::Mutex<Option<(Kind, Vec<Op>)>>,
}

impl Store for RacingStore {
    fn get<'a>(&'a self, kind: Kind, key: &'a str) -> BoxFut<'a, Option<Doc>> {
        self.inner.get(kind, key)
    }

    fn list<'a>(&'a self, kind: Kind, prefix: &'a str) -> BoxFut<'a, Vec<Doc>> {
        self.inner.list(kind, prefix)
    }

    fn batch(&self, ops: Vec<Op>) -> BoxFut<'_, Vec<Doc>> {
        let mut armed = self.race.lock().unwrap();
        let race = match armed.as_ref() {
            Some((kind, _))
                if ops
                    .iter()
                    .any(|o| matches!(o, Op::Put { kind: k, .. } if k == kind)) =>
            {
                armed.take().map(|(_, race)| race)
            }
            _ => None,
        };
        drop(armed);
        Box::pin(async move {
            if let Some(race) = race {
                self.inner.batch(race).await?;
            }
            self.inner.batch(ops).await
        })
    }

    fn changes(
        &self,
        kind: Kind,
        since: u64,
        limit: usize,
        wait: Duration,
    ) -> BoxFut<'_, (Vec<Change>, u64)> {
        self.inner.changes(kind, since, limit, wait)
    }

    fn head(&self) -> BoxFut<'_, u64> {
        self.inner.head()
    }

    fn trimmed(&self) -> BoxFut<'_, u64> {
        self.inner.trimmed()
    }

    fn ping(&self) -> BoxFut<'_, ()> {
        self.inner.ping()
    }
}

/// A node's heartbeat and a drain of it race (the broker drains itself at SIGTERM while
/// it heartbeats): whichever writes second reads again, and neither is refused. A
/// heartbeat answered 409 made the broker register again, as live, undoing the drain;
/// a drain answered 409 made the broker stop without handing its shards over.
#[test]
fn a_drain_and_the_nodes_heartbeat_racing_both_hold() {
    use felix_controlplane::model::{Lifecycle, Node};
    let store = Arc::new(RacingStore::default());
    let svc = start(store.clone(), runtime());
    let (anon, admin) = bootstrapped(&svc);
    let node = registered_node(&anon, &admin, "node-a", 5100);
    let read = || {
        svc.rt.block_on(async {
            let d = store.get(Kind::Node, "node-a").await.unwrap().unwrap();
            let n: Node = serde_json::from_value(d.value.clone()).unwrap();
            (d, n)
        })
    };
    // What the other party writes, on the version the handler is about to read.
    let arm = |lifecycle: Lifecycle| {
        let (d, mut n) = read();
        n.lifecycle = lifecycle;
        n.last_heartbeat_ms += 1;
        *store.race.lock().unwrap() = Some((
            Kind::Node,
            vec![Op::Put {
                kind: Kind::Node,
                key: "node-a".into(),
                value: serde_json::to_value(&n).unwrap(),
                expect: Expect::Version(d.version),
            }],
        ));
    };
    // A heartbeat lands while the drain writes.
    arm(Lifecycle::Live);
    node.post("/v1/nodes/node-a/drain", &json!({}))
        .expect("the drain reads again past the heartbeat");
    assert_eq!(read().1.lifecycle, Lifecycle::Draining);
    // A drain (of an operator, say: here written as it writes) lands while a heartbeat
    // writes. The node was live again for this half.
    let (d, mut n) = read();
    n.lifecycle = Lifecycle::Live;
    svc.rt.block_on(async {
        store
            .batch(vec![Op::Put {
                kind: Kind::Node,
                key: "node-a".into(),
                value: serde_json::to_value(&n).unwrap(),
                expect: Expect::Version(d.version),
            }])
            .await
            .unwrap();
    });
    arm(Lifecycle::Draining);
    let beat = node
        .post("/v1/nodes/node-a/heartbeat", &json!({"incarnation": 1}))
        .expect("the heartbeat reads again past the drain");
    assert_eq!(beat["lifecycle"], "draining", "{beat}");
    assert_eq!(read().1.lifecycle, Lifecycle::Draining, "the drain stands");
}

/// A stream deleted while a drain hands its node's shards over: the drain passes over
/// the shard that is gone and moves the rest. It answered 404 part way (some shards
/// moved, the answer lost), and a broker draining itself at SIGTERM gave up there.
#[test]
fn a_drain_passes_over_a_shard_deleted_under_it() {
    use felix_controlplane::model::AssignmentKey;
    let store = Arc::new(RacingStore::default());
    let svc = start(store.clone(), runtime());
    let (anon, admin) = bootstrapped(&svc);
    let drainer = registered_node(&anon, &admin, "node-a", 5100);
    registered_node(&anon, &admin, "node-b", 5101);
    let led_by_a = |name: &str| Assignment {
        key: AssignmentKey {
            tenant_id: "acme".into(),
            namespace: "ns".into(),
            kind: "stream".into(),
            name: name.into(),
            shard: 0,
        },
        leader: "node-a".into(),
        replicas: vec!["node-a".into(), "node-b".into()],
        generation: 1,
        state: "active".into(),
        routing: None,
        staging: None,
        replaces: None,
        retiring: None,
        abandoned: None,
        handoff: None,
    };
    let (gone, kept) = (led_by_a("gone"), led_by_a("kept"));
    svc.rt.block_on(async {
        for a in [&gone, &kept] {
            store
                .batch(vec![Op::Put {
                    kind: Kind::Assignment,
                    key: a.key.store_key(),
                    value: serde_json::to_value(a).unwrap(),
                    expect: Expect::Absent,
                }])
                .await
                .unwrap();
        }
    });
    // "gone"'s stream is deleted as the drain writes it (listed first, by key).
    *store.race.lock().unwrap() = Some((
        Kind::Assignment,
        vec![Op::Delete {
            kind: Kind::Assignment,
            key: gone.key.store_key(),
            expect: Expect::Present,
        }],
    ));
    let answer = drainer
        .post("/v1/nodes/node-a/drain", &json!({}))
        .expect("a shard deleted under the drain is passed over");
    assert_eq!(
        answer["moved"],
        json!([{"shard": kept.key.store_key(), "leader": "node-b", "generation": 2}]),
        "{answer}"
    );
}

/// A node that drained and went silent goes down like a live one, and can then be
/// deleted: a broker drains itself at SIGTERM and exits, and its record stayed
/// `Draining` for good (a delete answered 409, brokers kept it as a peer, and its
/// copies were never replaced).
#[test]
fn a_drained_node_that_went_silent_goes_down_and_can_be_deleted() {
    let svc = memory_service();
    let (anon, admin) = bootstrapped(&svc);
    let drainer = registered_node(&anon, &admin, "node-a", 5200);
    registered_node(&anon, &admin, "node-b", 5201);
    drainer.post("/v1/nodes/node-a/drain", &json!({})).unwrap();
    expect_err(admin.delete("/v1/nodes/node-a"), 409);
    let pass = |now_ms: u64| {
        svc.rt
            .block_on(placement::pass_at(
                svc.store.as_ref(),
                &svc.config,
                &svc.reports,
                (now_ms, 0),
            ))
            .unwrap()
    };
    let now = felix_controlplane::api::liveness_ms();
    silence(&svc, "node-a", now);
    assert!(pass(now).nodes_down.is_empty(), "heard from just now");
    let later = now + svc.config.down_after().as_millis() as u64 + 1;
    silence(&svc, "node-b", later);
    let report = pass(later);
    assert_eq!(report.nodes_down, vec!["node-a".to_string()], "{report:?}");
    admin.delete("/v1/nodes/node-a").unwrap();
}

/// A drain hands a shard to a member its leader does not report halted or rebuilding:
/// the first ready member in set order was taken, and a halted one (its log disagrees
/// below the commit mark) could never finish taking the shard over, nor a rebuilding
/// one win an election.
#[test]
fn a_drain_passes_over_a_halted_or_rebuilding_member() {
    use felix_controlplane::model::AssignmentKey;
    let svc = memory_service();
    let (anon, admin) = bootstrapped(&svc);
    let drainer = registered_node(&anon, &admin, "node-a", 5200);
    registered_node(&anon, &admin, "node-b", 5201);
    registered_node(&anon, &admin, "node-c", 5202);
    registered_node(&anon, &admin, "node-d", 5203);
    let a = Assignment {
        key: AssignmentKey {
            tenant_id: "acme".into(),
            namespace: "ns".into(),
            kind: "stream".into(),
            name: "s".into(),
            shard: 0,
        },
        leader: "node-a".into(),
        replicas: vec![
            "node-a".into(),
            "node-b".into(),
            "node-c".into(),
            "node-d".into(),
        ],
        generation: 1,
        state: "active".into(),
        routing: None,
        staging: None,
        replaces: None,
        retiring: None,
        abandoned: None,
        handoff: None,
    };
    svc.rt.block_on(async {
        svc.store
            .batch(vec![Op::Put {
                kind: Kind::Assignment,
                key: a.key.store_key(),
                value: serde_json::to_value(&a).unwrap(),
                expect: Expect::Absent,
            }])
            .await
            .unwrap();
    });
    drainer
        .post(
            "/v1/nodes/node-a/replica-status",
            &json!({"shards": [{"kind": "stream", "tenant_id": "acme", "namespace": "ns",
                    "name": "s", "shard": 0, "generation": 1, "log_end": 100, "commit": 100,
                    "followers": [
                        {"node_id": "node-b", "durable_end": 100, "halted": true},
                        {"node_id": "node-c", "durable_end": 0, "rebuilding": true},
                        {"node_id": "node-d", "durable_end": 100}]}]}),
        )
        .unwrap();
    let answer = drainer.post("/v1/nodes/node-a/drain", &json!({})).unwrap();
    assert_eq!(
        answer["moved"],
        json!([{"shard": a.key.store_key(), "leader": "node-d", "generation": 2}]),
        "{answer}"
    );
}

/// A NUL in any string of a request body is refused 400, on every store: Postgres's
/// JSONB refuses U+0000, so such a token subject, display name or reason failed there
/// as `unavailable` (and an audit entry naming that subject went missing), while the
/// memory store took it.
#[test]
fn a_nul_in_a_request_body_is_refused_on_every_store() {
    let svc = memory_service();
    let (_, admin) = bootstrapped(&svc);
    let (code, field) = expect_err(
        admin.post(
            "/v1/tenants",
            &json!({"tenant_id": "acme", "display_name": "a\u{0}b"}),
        ),
        400,
    );
    assert_eq!(code.as_deref(), Some("invalid"));
    assert_eq!(field.as_deref(), Some("body"));
    admin
        .post("/v1/tenants", &json!({"tenant_id": "acme"}))
        .unwrap();
    expect_err(
        admin.post(
            "/v1/tenants/acme/tokens",
            &json!({"sub": "x\u{0}", "audience": "felix-broker", "perms": []}),
        ),
        400,
    );
}

/// The Postgres store on a fresh database, over TLS, with its runtime and URL.
fn postgres_store() -> (
    felix_controlplane::pg::PgStore,
    tokio::runtime::Runtime,
    String,
) {
    let (url, rt) = fresh_database();
    let store = postgres_store_at(&url, &rt);
    (store, rt, url)
}

/// A key's versions never repeat, across a delete and a create again: per-key counters
/// began at 1 again, and a write conditional on a version read before the delete
/// landed on the new document. Only assignments go to the change log: every kind did,
/// tenants' signing keys too, and the log kept them for good.
async fn versions_and_the_change_log(store: &dyn Store) {
    let put = |kind: Kind, key: &str, expect: Expect| Op::Put {
        kind,
        key: key.into(),
        value: json!({"private": "secret"}),
        expect,
    };
    let first = store
        .batch(vec![put(Kind::Stream, "t/ns/s", Expect::Absent)])
        .await
        .unwrap();
    let read = first[0].version;
    store
        .batch(vec![Op::Delete {
            kind: Kind::Stream,
            key: "t/ns/s".into(),
            expect: Expect::Version(read),
        }])
        .await
        .unwrap();
    let again = store
        .batch(vec![put(Kind::Stream, "t/ns/s", Expect::Absent)])
        .await
        .unwrap();
    assert_ne!(again[0].version, read, "a version given twice");
    let stale = store
        .batch(vec![put(Kind::Stream, "t/ns/s", Expect::Version(read))])
        .await;
    assert!(
        stale.is_err(),
        "a write at a version read before the delete"
    );
    let updated = store
        .batch(vec![put(
            Kind::Stream,
            "t/ns/s",
            Expect::Version(again[0].version),
        )])
        .await
        .unwrap();
    assert!(updated[0].version > again[0].version);
    store
        .batch(vec![
            put(Kind::SigningKey, "t/k1", Expect::Absent),
            put(Kind::Assignment, "stream/t/ns/s/0", Expect::Absent),
        ])
        .await
        .unwrap();
    for kind in [Kind::SigningKey, Kind::Stream] {
        let (logged, _) = store.changes(kind, 0, 1000, Duration::ZERO).await.unwrap();
        assert!(logged.is_empty(), "{kind:?} changes logged: {logged:?}");
    }
    let (assignments, _) = store
        .changes(Kind::Assignment, 0, 1000, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(assignments.len(), 1);
}

/// Changes logged past what the log keeps: a quarter over and some.
const LOGGED: usize = CHANGES_KEPT + CHANGES_KEPT / 4 + 100;

/// Logs changes `k{from}` to `k{to - 1}` through `store`.
async fn log_changes(store: &dyn Store, from: usize, to: usize) {
    let ops = (from..to)
        .map(|i| Op::Put {
            kind: Kind::Assignment,
            key: format!("k{i}"),
            value: json!({"i": i}),
            expect: Expect::Any,
        })
        .collect();
    store.batch(ops).await.unwrap();
}

/// After [`LOGGED`] changes the log keeps its newest [`CHANGES_KEPT`] at most (every
/// placement change was kept for good), and says up to where it cut.
async fn the_change_log_kept_its_newest(store: &dyn Store) {
    let (kept, head) = store
        .changes(Kind::Assignment, 0, 100_000, Duration::ZERO)
        .await
        .unwrap();
    let trimmed = store.trimmed().await.unwrap();
    assert!(
        (CHANGES_KEPT / 2..=CHANGES_KEPT).contains(&kept.len()),
        "{} changes kept",
        kept.len()
    );
    assert!(
        trimmed > 0 && kept[0].seq > trimmed,
        "cut up to {trimmed}, kept from {}",
        kept[0].seq
    );
    assert_eq!(kept.last().unwrap().key, format!("k{}", LOGGED - 1));
    // A reader near the head misses nothing.
    let (recent, _) = store
        .changes(
            Kind::Assignment,
            kept[kept.len() - 6].seq,
            1000,
            Duration::ZERO,
        )
        .await
        .unwrap();
    assert_eq!(recent.len(), 5);
    assert!(head >= trimmed);
}

#[test]
fn the_change_log_keeps_its_newest_changes_in_memory() {
    let store = MemoryStore::new();
    runtime().block_on(async {
        for from in (0..LOGGED).step_by(600) {
            log_changes(&store, from, (from + 600).min(LOGGED)).await;
        }
        the_change_log_kept_its_newest(&store).await;
    });
}

/// On Postgres a write cuts at most `TRIM_BATCH` old changes: a backlog kept before
/// (every placement change was) is cut over the next writes, not in one that could
/// outlive its deadline, and `trimmed` says how far each got.
#[test]
fn the_change_log_keeps_its_newest_changes_in_postgres() {
    use felix_controlplane::pg::TRIM_BATCH;
    let (store, rt, url) = postgres_store();
    let backlog = CHANGES_KEPT + TRIM_BATCH + 2_600;
    // All but the last change written straight into the table (through the store, four
    // statements each, 12,600 of them took 16 s here); the store's own writes then cut.
    rt.block_on(async {
        let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        c.execute(
            "INSERT INTO felix_changes (kind, key, op, value) \
             SELECT 'assignment', 'k' || g, 'put', '{}'::jsonb FROM generate_series(0, $1::int - 2) g",
            &[&(backlog as i32)],
        )
        .await
        .unwrap();
        let kept = || async {
            let (kept, _) = store
                .changes(Kind::Assignment, 0, 100_000, Duration::ZERO)
                .await
                .unwrap();
            (kept.len(), store.trimmed().await.unwrap())
        };
        log_changes(&store, backlog - 1, backlog).await;
        // One batch cut: 10,000 of the 12,600 past the bound.
        assert_eq!(kept().await, (backlog - TRIM_BATCH, TRIM_BATCH as u64));
        log_changes(&store, backlog, backlog + 1).await;
        assert_eq!(kept().await, (CHANGES_KEPT, (backlog + 1 - CHANGES_KEPT) as u64));
    });
}

/// A feed reader asking from before what the log keeps is told to read the snapshot
/// again (`resync`); one at the head is not.
#[test]
fn the_feed_tells_a_reader_behind_what_it_keeps_to_resync() {
    let svc = memory_service();
    let (_, admin) = bootstrapped(&svc);
    svc.rt.block_on(log_changes(
        svc.store.as_ref(),
        0,
        CHANGES_KEPT + CHANGES_KEPT / 4 + 1,
    ));
    let behind = admin.get("/v1/shard-assignments/changes?since=0").unwrap();
    assert_eq!(behind["resync"], true, "{}", behind["next_seq"]);
    let head = svc.rt.block_on(svc.store.head()).unwrap();
    let current = admin
        .get(&format!("/v1/shard-assignments/changes?since={head}"))
        .unwrap();
    assert_eq!(current["resync"], false);
}

#[test]
fn versions_never_repeat_and_only_assignments_are_logged_in_memory() {
    runtime().block_on(versions_and_the_change_log(&MemoryStore::new()));
}

#[test]
fn versions_never_repeat_and_only_assignments_are_logged_in_postgres() {
    let (store, rt, _) = postgres_store();
    rt.block_on(versions_and_the_change_log(&store));
}

/// The Postgres store opens its connection again once it is lost (a Postgres restart
/// or failover, a reset): it failed every operation for good after one, and the control
/// plane with it.
#[test]
fn the_postgres_store_connects_again_after_losing_its_connection() {
    let (store, rt, url) = postgres_store();
    let (base, _) = test_postgres();
    let db = url.rsplit_once('/').unwrap().1.to_owned();
    rt.block_on(async {
        store.ping().await.unwrap();
        let (admin, conn) = tokio_postgres::connect(&base, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        let ended = admin
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = $1 AND pid <> pg_backend_pid()",
                &[&db],
            )
            .await
            .unwrap();
        assert_eq!(ended, 1, "the store's one session");
        // The loss may be seen by the first operation after it; not by every one.
        let started = std::time::Instant::now();
        loop {
            match store.ping().await {
                Ok(()) => break,
                Err(e) if started.elapsed() < Duration::from_secs(5) => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("still failing after 5 s: {e}"),
            }
        }
        store
            .batch(vec![Op::Put {
                kind: Kind::Tenant,
                key: "t".into(),
                value: json!({}),
                expect: Expect::Absent,
            }])
            .await
            .unwrap();
    });
}

/// A node's heartbeats (a write per node per second) do not go to the change log: they
/// grew it for good, in the memory store's memory and in a Postgres table.
#[test]
fn heartbeats_do_not_grow_the_change_log() {
    let rt = runtime();
    rt.block_on(async {
        let store = MemoryStore::new();
        let put = |kind: Kind, key: &str, version: Option<u64>| Op::Put {
            kind,
            key: key.into(),
            value: json!({"n": version}),
            expect: version.map_or(Expect::Absent, Expect::Version),
        };
        store
            .batch(vec![put(Kind::Assignment, "a/0", None)])
            .await
            .unwrap();
        let mut v = store.batch(vec![put(Kind::Node, "n", None)]).await.unwrap()[0].version;
        for _ in 0..10_000 {
            v = store
                .batch(vec![put(Kind::Node, "n", Some(v))])
                .await
                .unwrap()[0]
                .version;
        }
        let (nodes, _) = store
            .changes(Kind::Node, 0, usize::MAX, Duration::ZERO)
            .await
            .unwrap();
        assert!(nodes.is_empty(), "{} node changes logged", nodes.len());
        let (assignments, _) = store
            .changes(Kind::Assignment, 0, usize::MAX, Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(assignments.len(), 1, "assignment changes are still logged");
    });
}

/// A stop finishes though a client never sends a whole request: hyper counts the
/// connection busy until its request is read (no header timeout is set), and the stop
/// waited for it for good. Connections left past the grace are closed.
#[test]
fn a_stop_does_not_wait_for_good_on_a_half_sent_request() {
    use std::io::Write as _;
    let mut svc = memory_service();
    let addr = svc.url.trim_start_matches("http://").to_owned();
    let mut half = std::net::TcpStream::connect(&addr).unwrap();
    half.write_all(b"POST /v1/tenants HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    // Taken and read in part by the server.
    std::thread::sleep(Duration::from_millis(300));
    let running = svc.running.take().unwrap();
    let started = std::time::Instant::now();
    let stopped = svc.rt.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(10),
            running.stop_within(Duration::from_millis(300)),
        )
        .await
    });
    assert!(stopped.is_ok(), "the stop still waited after 10 s");
    assert!(started.elapsed() < Duration::from_secs(5));
    drop(half);
}

/// Drops the kept totals (as in a store from before they were kept, the placement
/// pass the service ran at its start having written them): the next counted write
/// counts the store whole.
fn forget_totals(svc: &Service) {
    svc.rt
        .block_on(svc.store.batch(vec![Op::Delete {
            kind: Kind::Meta,
            key: "limits-fence".into(),
            expect: Expect::Any,
        }]))
        .unwrap();
}

/// Writes `ops` straight to the store, past the handlers (and their counts).
fn write_past_the_handlers(svc: &Service, ops: Vec<Op>) {
    svc.rt.block_on(svc.store.batch(ops)).unwrap();
}

/// The cluster's kept totals (the fence document).
fn kept_totals(svc: &Service) -> Doc {
    svc.rt
        .block_on(svc.store.get(Kind::Meta, "limits-fence"))
        .unwrap()
        .expect("totals kept")
}

/// A denial of `tenant`'s token `jti` until `until`, to write past the handlers.
fn denial_doc(tenant: &str, jti: &str, until: u64) -> Op {
    Op::Put {
        kind: Kind::Denial,
        key: format!("{tenant}/{jti}"),
        value: json!({"tenant_id": tenant, "jti": jti, "until": until}),
        expect: Expect::Absent,
    }
}

/// Seconds since the epoch, as denials count them.
fn epoch_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// The message of a refusal with status `want`.
fn refused_saying(r: Result<Value, ClientError>, want: u16) -> String {
    match r {
        Err(ClientError::Api {
            status, message, ..
        }) if status == want => message,
        other => panic!("expected HTTP {want}, got {other:?}"),
    }
}

/// One tenant cannot grow what every broker reads whole past what a broker reads: its
/// shards are bounded, and so are the cluster's, so no broker's sync is ever refused.
/// A delete makes room again.
#[test]
fn a_tenants_shards_and_the_clusters_stay_within_their_bounds() {
    use felix_controlplane::limits::{CLUSTER_SHARDS_MAX, TENANT_SHARDS_MAX};
    assert_eq!((TENANT_SHARDS_MAX, CLUSTER_SHARDS_MAX), (8_192, 16_384));
    let svc = memory_service();
    let (_, admin) = bootstrapped(&svc);
    // A stream stored before the bounds were kept (no totals yet): counted at the first
    // counted write.
    write_past_the_handlers(
        &svc,
        vec![Op::Put {
            kind: Kind::Stream,
            key: "old/ns/s".into(),
            value: json!({"tenant_id": "old", "namespace": "ns", "stream": "s",
                          "kind": "Stream", "shards": 4096}),
            expect: Expect::Absent,
        }],
    );
    forget_totals(&svc);
    for t in ["acme", "beta", "gamma"] {
        admin.post("/v1/tenants", &json!({"tenant_id": t})).unwrap();
        admin
            .post(
                &format!("/v1/tenants/{t}/namespaces"),
                &json!({"namespace": "ns"}),
            )
            .unwrap();
    }
    let stream = |t: &str, name: &str, shards: u32| {
        admin.post(
            &format!("/v1/tenants/{t}/namespaces/ns/streams"),
            &json!({"stream": name, "kind": "Stream", "shards": shards}),
        )
    };
    let cache = |t: &str, name: &str, shards: u32| {
        admin.post(
            &format!("/v1/tenants/{t}/namespaces/ns/caches"),
            &json!({"cache": name, "shards": shards}),
        )
    };
    stream("acme", "a", 4096).unwrap();
    stream("acme", "b", 4095).unwrap();
    cache("acme", "c", 1).unwrap();
    // The tenant's bound counts streams and caches together.
    let m = refused_saying(stream("acme", "d", 1), 409);
    assert!(m.contains("tenant acme holds 8192 shards"));
    expect_err(cache("acme", "e", 1), 409);

    stream("beta", "a", 4096).unwrap();
    // Past the cluster's bound (with the old stream's), though beta holds 4,096 and
    // gamma nothing.
    let m = refused_saying(stream("beta", "b", 1), 409);
    assert!(m.contains("the cluster holds 16384 shards"), "{m}");
    let m = refused_saying(stream("gamma", "a", 1), 409);
    assert!(m.contains("the cluster holds 16384 shards"), "{m}");

    admin
        .delete("/v1/tenants/acme/namespaces/ns/caches/c")
        .unwrap();
    stream("gamma", "a", 1).unwrap();
    expect_err(cache("acme", "c", 1), 409);
    // A name taken is still told as such.
    let m = refused_saying(stream("gamma", "a", 1), 409);
    assert!(m.contains("already exists"));
}

/// Creates at once cannot together pass a bound each would pass alone: of eight
/// 4,096-shard streams created at once by one tenant, in eight namespaces (so no
/// namespace's version orders them), each through a control plane of its own over one
/// store (whose counted writes do not take turns together: the fence's version alone
/// orders them), exactly two are taken.
#[test]
fn creates_at_once_cannot_pass_the_shard_bound_together() {
    for services in control_planes(8) {
        let admins = admins_of(&services.iter().collect::<Vec<_>>());
        let admin = &admins[0];
        acme_with_namespaces(admin, 8);
        taken_at_once(2, |i| {
            admins[i].post(
                &format!("/v1/tenants/acme/namespaces/ns{i}/streams"),
                &json!({"stream": "s", "kind": "Stream", "shards": 4096}),
            )
        });
    }
}

/// Counted writes within the bounds, 32 at once (creates in 32 namespaces, all
/// rewriting the one fence that keeps the cluster's totals), on one control plane, then
/// half on each of two over one store (memory, then Postgres): every one is taken. Tried again at once after
/// each conflict, most lost all eight tries to the others and were refused 409 "retry"
/// (23 of 32 on one control plane). One control plane's writes take turns (with only
/// pauses between tries, about one of 32 was still refused there); two control planes'
/// writes race, and pause between tries (without turns or pauses, a quarter of them
/// were refused).
#[test]
fn counted_writes_at_once_within_the_bounds_are_all_taken() {
    let alone = memory_service();
    let [memory, pg] = control_planes(2);
    for services in [
        vec![&alone, &alone],
        memory.iter().collect(),
        pg.iter().collect(),
    ] {
        let admins = admins_of(&services);
        let admin = &admins[0];
        acme_with_namespaces(admin, 32);
        let results = statuses_at_once(32, |i| {
            admins[i % 2].post(
                &format!("/v1/tenants/acme/namespaces/ns{i}/streams"),
                &json!({"stream": "s", "kind": "Stream", "shards": 1}),
            )
        });
        assert!(results.iter().all(|s| *s == 200), "{results:?}");
    }
}

/// A token cannot outlive, through what it mints or denies, what revoking it ends: a
/// tenant admin whose token has ten minutes left mints tokens of ten minutes at most
/// (it minted tokens of a year, which denying it left running), one past its expiry
/// mints none (the operator's tokens are exempt), and re-denying a
/// denied token extends its denial but never shortens it (a tenant token minted before
/// the denial lifted it by denying it again until a moment from now); the operator
/// may still shorten one made in error.
#[test]
fn a_token_cannot_outlive_its_minter_or_lift_a_denial() {
    use base64::Engine as _;
    let svc = memory_service();
    let (_, admin) = bootstrapped(&svc);
    admin
        .post("/v1/tenants", &json!({"tenant_id": "acme"}))
        .unwrap();
    let mint = |c: &ControlPlaneClient, ttl: u64| {
        c.post(
            "/v1/tenants/acme/tokens",
            &json!({"sub": "alice", "audience": "felix-controlplane",
                    "perms": ["tenant.manage:tenant:acme"], "ttl_seconds": ttl}),
        )
        .unwrap()
    };
    let exp_of = |token: &str| -> u64 {
        let claims = token.split('.').nth(1).unwrap();
        let claims: Value = serde_json::from_slice(
            &base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(claims)
                .unwrap(),
        )
        .unwrap();
        claims["exp"].as_u64().unwrap()
    };
    let short = mint(&admin, 600);
    let acme = admin.clone().with_token(short["token"].as_str().unwrap());
    let year = 365 * 24 * 3600;
    let minted = mint(&acme, year);
    let expires_in = minted["expires_in"].as_u64().unwrap();
    assert!(expires_in <= 600, "{minted}");
    assert!(
        exp_of(minted["token"].as_str().unwrap()) <= exp_of(short["token"].as_str().unwrap()),
        "the minted token expires no later than its minter"
    );
    // A token in the minute of skew past its expiry (still accepted) mints none: a
    // token it minted would outlive it, and could mint the next.
    let lapsing = admin
        .clone()
        .with_token(mint(&admin, 1)["token"].as_str().unwrap());
    std::thread::sleep(std::time::Duration::from_millis(2100));
    lapsing.get("/v1/tenants/acme/namespaces").unwrap();
    expect_err(
        lapsing.post(
            "/v1/tenants/acme/tokens",
            &json!({"sub": "alice", "audience": "felix-controlplane",
                    "perms": ["tenant.manage:tenant:acme"]}),
        ),
        403,
    );
    // The operator's tokens are exempt: every token descends from the bootstrap token
    // (a year), and the cluster's must outlive it.
    assert_eq!(mint(&admin, year)["expires_in"], year);

    let now = epoch_secs();
    let deny = |c: &ControlPlaneClient, until: u64| {
        c.post(
            "/v1/tenants/acme/token-denials",
            &json!({"jti": "leaked", "until": until}),
        )
        .unwrap()
    };
    let held = || -> u64 {
        admin.get("/v1/tenants/acme/token-denials").unwrap()["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["jti"] == "leaked")
            .expect("the denial is held")["until"]
            .as_u64()
            .unwrap()
    };
    deny(&admin, now + 3600);
    assert_eq!(deny(&acme, now + 10)["until"], now + 3600);
    assert_eq!(held(), now + 3600, "a tenant token cannot shorten a denial");
    deny(&acme, now + 7200);
    assert_eq!(held(), now + 7200, "it can extend one");
    deny(&admin, now + 10);
    assert_eq!(held(), now + 10, "the operator can shorten one");
}

/// A tenant holds at most 1,024 denials in force: past them a denial is refused 409 (a
/// renewal of one in force is not), and its lapsed denials are dropped from the store
/// by its next denial rather than kept for good.
#[test]
fn a_tenants_denials_are_bounded_and_lapsed_ones_are_dropped() {
    use felix_controlplane::limits::TENANT_DENIALS_MAX;
    let svc = memory_service();
    let (_, admin) = bootstrapped(&svc);
    admin
        .post("/v1/tenants", &json!({"tenant_id": "acme"}))
        .unwrap();
    admin
        .post("/v1/tenants", &json!({"tenant_id": "beta"}))
        .unwrap();
    let now = epoch_secs();
    let deny = |t: &str, jti: &str, until: u64| {
        admin.post(
            &format!("/v1/tenants/{t}/token-denials"),
            &json!({"jti": jti, "until": until}),
        )
    };
    // Lapsed already: refused, as it would refuse nothing.
    expect_err(deny("acme", "past", now - 3600), 400);
    // One that lapsed since (written here directly): counts for nothing, and goes.
    write_past_the_handlers(&svc, vec![denial_doc("acme", "old", now - 3600)]);
    forget_totals(&svc);
    for i in 0..TENANT_DENIALS_MAX {
        deny("acme", &format!("j{i}"), now + 3600).unwrap();
    }
    let m = refused_saying(deny("acme", "one-more", now + 3600), 409);
    assert!(m.contains("retire"));
    deny("acme", "j0", now + 7200).unwrap();
    deny("beta", "j0", now + 3600).unwrap();
    let stored = svc
        .rt
        .block_on(svc.store.list(Kind::Denial, "acme/"))
        .unwrap();
    assert_eq!(
        stored.len(),
        TENANT_DENIALS_MAX,
        "the lapsed one was dropped"
    );
    assert!(stored.iter().all(|d| d.key != "acme/old"));

    // Deleting a tenant takes its denials, and their count, with it.
    admin.delete("/v1/tenants/acme").unwrap();
    let left = svc.rt.block_on(svc.store.list(Kind::Denial, "")).unwrap();
    assert_eq!(left.len(), 1, "beta's alone");
    assert_eq!(kept_totals(&svc).value["denials"], 1);
}

/// Totals moved from the truth by writes outside the counted handlers (an older
/// control plane beside this one during an upgrade) are mended by the next placement
/// pass, both ways, and stored denials past half the cluster's bound lose their lapsed
/// ones there.
#[test]
fn the_placement_pass_mends_the_kept_totals() {
    let svc = memory_service();
    let (_, admin) = bootstrapped(&svc);
    admin
        .post("/v1/tenants", &json!({"tenant_id": "acme"}))
        .unwrap();
    admin
        .post("/v1/tenants/acme/namespaces", &json!({"namespace": "ns"}))
        .unwrap();
    admin
        .post(
            "/v1/tenants/acme/namespaces/ns/streams",
            &json!({"stream": "s", "kind": "Stream", "shards": 3}),
        )
        .unwrap();
    let fence = || kept_totals(&svc);
    let set = |value: Value| {
        let d = fence();
        write_past_the_handlers(
            &svc,
            vec![Op::Put {
                kind: Kind::Meta,
                key: "limits-fence".into(),
                value,
                expect: Expect::Version(d.version),
            }],
        );
    };
    let pass = || {
        svc.rt
            .block_on(placement::pass(
                svc.store.as_ref(),
                &svc.config,
                &svc.reports,
            ))
            .unwrap();
    };
    assert_eq!(fence().value, json!({"shards": 3, "denials": 0}));
    // Over and under the truth.
    set(json!({"shards": 16_000, "denials": 0}));
    pass();
    assert_eq!(fence().value["shards"], 3);
    set(json!({"shards": 0, "denials": 0}));
    pass();
    assert_eq!(fence().value["shards"], 3);
    // Denials: lapsed ones stored past half the bound are dropped.
    let now = epoch_secs();
    write_past_the_handlers(
        &svc,
        vec![
            denial_doc("acme", "lapsed", now - 3600),
            denial_doc("acme", "live", now + 3600),
        ],
    );
    set(json!({"shards": 3, "denials": 9_000}));
    pass();
    assert_eq!(fence().value, json!({"shards": 3, "denials": 1}));
    let left = svc.rt.block_on(svc.store.list(Kind::Denial, "")).unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].key, "acme/live");
}

/// Display names are bounded: a cache's goes into the streams snapshot every broker
/// reads whole.
#[test]
fn display_names_are_bounded() {
    let svc = memory_service();
    let (_, admin) = bootstrapped(&svc);
    let long = "d".repeat(257);
    expect_err(
        admin.post(
            "/v1/tenants",
            &json!({"tenant_id": "acme", "display_name": long}),
        ),
        400,
    );
    admin
        .post(
            "/v1/tenants",
            &json!({"tenant_id": "acme", "display_name": &long[1..]}),
        )
        .unwrap();
    expect_err(
        admin.post(
            "/v1/tenants/acme/namespaces",
            &json!({"namespace": "ns", "display_name": long}),
        ),
        400,
    );
    admin
        .post("/v1/tenants/acme/namespaces", &json!({"namespace": "ns"}))
        .unwrap();
    expect_err(
        admin.post(
            "/v1/tenants/acme/namespaces/ns/caches",
            &json!({"cache": "c", "display_name": long}),
        ),
        400,
    );
}
