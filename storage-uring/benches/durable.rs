//! Durable-append benchmark: our log against two baselines, in one run on one disk.
//!
//! For 1, 8 and 64 concurrent appenders of 1 KiB records with on-commit fsync, measures
//! durable appends/s and append-to-durable latency (p50/p99) for:
//! - `buffered`: plain buffered `write` + `fdatasync` per append, one thread per appender;
//! - `raw-gc`: a minimal group-commit loop on the same executor and O_DIRECT files: take
//!   every pending append, one write, one fdatasync, release them all;
//! - `log`: `SegmentLog` with `FsyncMode::OnCommit`.
//!
//! Cells are interleaved and repeated (rounds), and medians are reported, because these
//! machines are shared. It also measures one-at-a-time fdatasync latency just before,
//! and recovery speed over a 1 GiB segment.
//!
//! Run: `cargo bench -p felix-storage-uring --bench durable` (env `FELIX_BENCH_DIR`
//! picks the disk, default /var/tmp; `FELIX_BENCH_SECS` the cell length, default 2).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::poll_fn;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use felix_storage_uring::io::{Backend, SegmentFile};
use felix_storage_uring::{DmaBackend, FsyncMode, LogConfig, SegmentLog, VerifyOnOpen};

const RECORD: usize = 1024;

#[derive(Debug, Default, Clone)]
struct Cell {
    appends: u64,
    secs: f64,
    lat_us: Vec<f64>,
}

impl Cell {
    fn rate(&self) -> f64 {
        self.appends as f64 / self.secs
    }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn fresh_dir(root: &Path, name: &str) -> PathBuf {
    let d = root.join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Plain buffered write + fdatasync per append, `n` threads sharing one file.
fn buffered(root: &Path, n: usize, secs: f64) -> Cell {
    let dir = fresh_dir(root, "buffered");
    let file = std::sync::Arc::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("data"))
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let threads: Vec<_> = (0..n)
        .map(|_| {
            let file = file.clone();
            std::thread::spawn(move || {
                let rec = vec![7u8; RECORD];
                let mut lat = Vec::new();
                while Instant::now() < deadline {
                    let t = Instant::now();
                    (&*file).write_all(&rec).unwrap();
                    file.sync_data().unwrap();
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                }
                lat
            })
        })
        .collect();
    let started = Instant::now();
    let mut cell = Cell::default();
    for t in threads {
        let lat = t.join().unwrap();
        cell.appends += lat.len() as u64;
        cell.lat_us.extend(lat);
    }
    cell.secs = started.elapsed().as_secs_f64().max(secs);
    cell
}

/// The minimal group-commit loop: what our log must come close to.
async fn raw_group_commit(root: &Path, n: usize, secs: f64) -> Cell {
    let dir = fresh_dir(root, "raw");
    let backend = DmaBackend::open_dir(&dir).await.unwrap();
    let file = Rc::new(backend.open("data", true).await.unwrap());
    file.allocate(1 << 30).await.unwrap();
    type Done = Rc<RefCell<Option<Instant>>>;
    #[derive(Default)]
    struct Q {
        pending: VecDeque<(Vec<u8>, Done)>,
        waiters: Vec<(Done, Waker)>,
        loop_waker: Option<Waker>,
        stop: bool,
    }
    let q = Rc::new(RefCell::new(Q::default()));
    let looper = {
        let q = q.clone();
        let file = file.clone();
        glommio::spawn_local(async move {
            // Bytes of the last partial block, rewritten in front of the next write.
            let mut len = 0u64;
            let mut tail: Vec<u8> = Vec::new();
            let mut out: Vec<u8> = Vec::new();
            loop {
                let batch: Vec<_> = poll_fn(|cx| {
                    let mut q = q.borrow_mut();
                    if q.stop {
                        return Poll::Ready(None);
                    }
                    if q.pending.is_empty() {
                        q.loop_waker = Some(cx.waker().clone());
                        return Poll::Pending;
                    }
                    Poll::Ready(Some(q.pending.drain(..).collect()))
                })
                .await
                .unwrap_or_default();
                if batch.is_empty() {
                    return;
                }
                let start = len & !4095;
                out.clear();
                out.extend_from_slice(&tail);
                for (rec, _) in &batch {
                    out.extend_from_slice(rec);
                }
                let end = out.len();
                out.resize((end + 4095) & !4095, 0);
                file.write_at(&out, start).await.unwrap();
                file.sync_data().await.unwrap();
                len = start + end as u64;
                tail.clear();
                tail.extend_from_slice(&out[end & !4095..end]);
                let now = Instant::now();
                let mut q = q.borrow_mut();
                for (_, done) in batch {
                    *done.borrow_mut() = Some(now);
                }
                for (_, w) in q.waiters.drain(..) {
                    w.wake();
                }
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..n {
        let q = q.clone();
        tasks.push(glommio::spawn_local(async move {
            let mut lat = Vec::new();
            while Instant::now() < deadline {
                let t = Instant::now();
                let done = Rc::new(RefCell::new(None));
                {
                    let mut q = q.borrow_mut();
                    q.pending.push_back((vec![7u8; RECORD], done.clone()));
                    if let Some(w) = q.loop_waker.take() {
                        w.wake();
                    }
                }
                poll_fn(|cx| {
                    if done.borrow().is_some() {
                        return Poll::Ready(());
                    }
                    q.borrow_mut()
                        .waiters
                        .push((done.clone(), cx.waker().clone()));
                    Poll::Pending
                })
                .await;
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            }
            lat
        }));
    }
    let mut cell = Cell::default();
    for t in tasks {
        let lat = t.await;
        cell.appends += lat.len() as u64;
        cell.lat_us.extend(lat);
    }
    cell.secs = started.elapsed().as_secs_f64();
    {
        let mut q = q.borrow_mut();
        q.stop = true;
        if let Some(w) = q.loop_waker.take() {
            w.wake();
        }
    }
    looper.await;
    cell
}

async fn our_log(root: &Path, n: usize, secs: f64) -> Cell {
    let dir = fresh_dir(root, "log");
    let backend = DmaBackend::open_dir(&dir).await.unwrap();
    let (log, _) = SegmentLog::open(
        backend,
        LogConfig {
            fsync: FsyncMode::OnCommit,
            segment_bytes_max: 1 << 30,
            ..LogConfig::default()
        },
    )
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..n {
        let log = log.clone();
        tasks.push(glommio::spawn_local(async move {
            let rec = vec![7u8; RECORD];
            let mut lat = Vec::new();
            while Instant::now() < deadline {
                let t = Instant::now();
                let p = log.begin_append(&[&rec], 0, None).unwrap();
                log.commit(p).await.unwrap();
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            }
            lat
        }));
    }
    let mut cell = Cell::default();
    for t in tasks {
        let lat = t.await;
        cell.appends += lat.len() as u64;
        cell.lat_us.extend(lat);
    }
    cell.secs = started.elapsed().as_secs_f64();
    log.close().await.unwrap();
    cell
}

/// One 4 KiB write + fdatasync at a time, into a preallocated file: the floor every
/// durable ack pays.
fn fdatasync_latency(root: &Path) -> (f64, f64) {
    let dir = fresh_dir(root, "fsync");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .read(true)
        .open(dir.join("data"))
        .unwrap();
    f.set_len(8 << 20).unwrap();
    f.sync_all().unwrap();
    let block = vec![1u8; 4096];
    let mut lat = Vec::new();
    for i in 0..400u64 {
        let t = Instant::now();
        f.write_all_at(&block, (i % 2048) * 4096).unwrap();
        f.sync_data().unwrap();
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    (pct(&mut lat, 0.5), pct(&mut lat, 0.99))
}

async fn recovery_speed(root: &Path) -> (f64, f64) {
    let dir = fresh_dir(root, "recovery");
    let config = LogConfig {
        fsync: FsyncMode::None,
        segment_bytes_max: 1100 << 20,
        ..LogConfig::default()
    };
    let (log, _) = SegmentLog::open(DmaBackend::open_dir(&dir).await.unwrap(), config.clone())
        .await
        .unwrap();
    let batch: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 16 * 1024]).collect();
    while log.size_bytes() < 1 << 30 {
        let p = log.begin_append(&batch, 0, None).unwrap();
        log.commit(p).await.unwrap();
    }
    log.close().await.unwrap();
    drop(log);
    let size = std::fs::metadata(dir.join("00000000000000000000.seg"))
        .unwrap()
        .len();
    let started = Instant::now();
    let (log, report) = SegmentLog::open(
        DmaBackend::open_dir(&dir).await.unwrap(),
        LogConfig {
            verify_on_open: VerifyOnOpen::All,
            ..config
        },
    )
    .await
    .unwrap();
    let secs = started.elapsed().as_secs_f64();
    assert!(report.verified_bytes + 8192 >= size);
    log.close().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    (
        size as f64 / (1u64 << 30) as f64,
        size as f64 / (1u64 << 30) as f64 / secs,
    )
}

fn main() {
    let root =
        PathBuf::from(std::env::var("FELIX_BENCH_DIR").unwrap_or_else(|_| "/var/tmp".into()))
            .join("felix-storage-bench");
    let secs: f64 = std::env::var("FELIX_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    let rounds: usize = std::env::var("FELIX_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    std::fs::create_dir_all(&root).unwrap();
    let (f50, f99) = fdatasync_latency(&root);
    println!("disk: 4 KiB write+fdatasync one at a time: p50 {f50:.0} us, p99 {f99:.0} us");
    let concurrency = [1usize, 8, 64];
    let mut results: Vec<Vec<[Cell; 3]>> = vec![Vec::new(); concurrency.len()];
    let root2 = root.clone();
    let glommio_results = glommio::LocalExecutorBuilder::default()
        .spawn(move || async move {
            let mut per: Vec<Vec<(Cell, Cell)>> = vec![Vec::new(); 3];
            for round in 0..rounds {
                for (i, &n) in concurrency.iter().enumerate() {
                    // Alternate which runs first, so neither always gets the warm disk.
                    let (raw, log) = if round % 2 == 0 {
                        let raw = raw_group_commit(&root2, n, secs).await;
                        (raw, our_log(&root2, n, secs).await)
                    } else {
                        let log = our_log(&root2, n, secs).await;
                        (raw_group_commit(&root2, n, secs).await, log)
                    };
                    eprint!(".");
                    per[i].push((raw, log));
                }
            }
            let (gib, gibps) = recovery_speed(&root2).await;
            (per, gib, gibps)
        })
        .unwrap()
        .join()
        .unwrap();
    let (per, gib, gibps) = glommio_results;
    for (i, &n) in concurrency.iter().enumerate() {
        for (raw, log) in &per[i] {
            let b = buffered(&root, n, secs);
            results[i].push([b, raw.clone(), log.clone()]);
        }
    }
    eprintln!();
    println!(
        "\n| appenders | system | durable appends/s (median of {rounds}) | p50 us | p99 us | vs raw-gc | vs buffered |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (i, &n) in concurrency.iter().enumerate() {
        let rates: Vec<[f64; 3]> = results[i]
            .iter()
            .map(|c| [c[0].rate(), c[1].rate(), c[2].rate()])
            .collect();
        let med = |k: usize| median(rates.iter().map(|r| r[k]).collect());
        let (mb, mr, ml) = (med(0), med(1), med(2));
        for (k, name) in ["buffered", "raw-gc", "log"].iter().enumerate() {
            let mut lat: Vec<f64> = results[i]
                .iter()
                .flat_map(|c| c[k].lat_us.clone())
                .collect();
            let rate = [mb, mr, ml][k];
            println!(
                "| {n} | {name} | {rate:.0} | {:.0} | {:.0} | {:.2}x | {:.2}x |",
                pct(&mut lat, 0.5),
                pct(&mut lat, 0.99),
                rate / mr,
                rate / mb
            );
        }
    }
    println!("\nrecovery: {gib:.2} GiB segment verified at {gibps:.2} GiB/s");
    println!("fdatasync p99 x2 budget for log p99: {:.0} us", f99 * 2.0);
    let _ = std::io::stdout().flush();
    let _ = std::fs::remove_dir_all(&root);
}
