//! The cross-core mesh on real pinned executors.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use felix_core_runtime::mesh::{MeshBuilder, SendError};
use felix_core_runtime::runtime::{Runtime, RuntimeConfig};
use felix_core_runtime::{CoreId, CoreSet};

#[test]
fn the_mesh_delivers_in_order_per_pair_under_load_with_backpressure() {
    let cpus = felix_core_runtime::cores::available_cpus();
    let cores = CoreSet::new(
        vec![cpus[0], cpus[cpus.len() - 1]]
            .into_iter()
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect(),
    )
    .unwrap();
    let n = cores.len().max(2);
    let cores = if cores.len() < 2 {
        // One CPU: two executors may share it.
        CoreSet::new(vec![cpus[0]]).unwrap()
    } else {
        cores
    };
    if cores.len() < 2 {
        eprintln!("single-CPU machine: mesh test needs two executors; skipping");
        return;
    }
    let builder = Arc::new(std::sync::Mutex::new(MeshBuilder::<(usize, u64)>::new(
        n, 8,
    )));
    let full_seen = Arc::new(AtomicU64::new(0));
    let received = Arc::new(AtomicU64::new(0));
    const MESSAGES: u64 = 200_000;
    let (b, f, r) = (builder.clone(), full_seen.clone(), received.clone());
    let rt = Runtime::start(RuntimeConfig::new(cores), move |ctx| {
        let ends = b.lock().unwrap().take(ctx.core);
        let (full_seen, received) = (f.clone(), r.clone());
        async move {
            let mut mesh = ends.connect().await;
            let me = ctx.core.index();
            let peer = CoreId(1 - me);
            let receivers = mesh.take_receivers();
            let reader = glommio::spawn_local(async move {
                let (from, rx) = receivers.into_iter().next().unwrap();
                assert_eq!(from, peer);
                let mut expected = 0u64;
                while let Some((sender, seq)) = rx.recv().await {
                    assert_eq!(sender, peer.index());
                    assert_eq!(seq, expected, "in order");
                    expected += 1;
                    // A slow consumer now and then, so the producer meets a full channel.
                    if seq % 10_000 == 0 {
                        glommio::timer::sleep(std::time::Duration::from_millis(2)).await;
                    }
                    if expected == MESSAGES {
                        break;
                    }
                }
                expected
            });
            for seq in 0..MESSAGES {
                match mesh.try_send(peer, (me, seq)) {
                    Ok(()) => {}
                    Err(SendError::Full(m)) => {
                        full_seen.fetch_add(1, Ordering::Relaxed);
                        mesh.send(peer, m).await.unwrap();
                    }
                    Err(e) => panic!("send failed: {:?}", e.into_inner()),
                }
            }
            received.fetch_add(reader.await, Ordering::Relaxed);
        }
    })
    .unwrap();
    rt.join().unwrap();
    assert_eq!(received.load(Ordering::Relaxed), 2 * MESSAGES);
    assert!(
        full_seen.load(Ordering::Relaxed) > 0,
        "backpressure was exercised"
    );
}
