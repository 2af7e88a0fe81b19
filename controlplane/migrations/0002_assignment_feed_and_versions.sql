-- Document versions come from one sequence, so a key's versions never repeat, across a
-- delete and a create again too (per-key counters restarted at 1, and a write
-- conditional on a version read before the delete landed on the new document). It
-- starts past every version and change number already in use.
CREATE SEQUENCE IF NOT EXISTS felix_doc_versions;
SELECT setval('felix_doc_versions', GREATEST(
    (SELECT COALESCE(MAX(version), 0) FROM felix_docs),
    (SELECT COALESCE(MAX(seq), 0) FROM felix_changes),
    1));

-- Only the assignment feed is read (brokers follow it). Every other kind's writes were
-- logged as well and never read: tenants' signing keys among them, in clear for keys
-- stored before sealing and under retired key-encryption keys after a rotation, kept for
-- good. The change log keeps assignments only.
DELETE FROM felix_changes WHERE kind <> 'assignment';
