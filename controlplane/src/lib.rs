//! The REST control plane. Not built yet: see issue 6.
