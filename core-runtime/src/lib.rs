//! Per-core executors and the QUIC driver. Not built yet: see issue 4.
