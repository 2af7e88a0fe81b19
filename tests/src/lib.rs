//! The cluster harness. Not built yet: it follows the broker and control plane.
