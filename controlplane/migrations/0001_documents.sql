-- Every resource is a versioned JSON document; every write appends to a change log
-- (the assignment feed brokers follow). One migration table records what ran.
CREATE TABLE IF NOT EXISTS felix_docs (
    kind    TEXT   NOT NULL,
    key     TEXT   NOT NULL,
    version BIGINT NOT NULL,
    value   JSONB  NOT NULL,
    PRIMARY KEY (kind, key)
);

CREATE TABLE IF NOT EXISTS felix_changes (
    seq   BIGSERIAL PRIMARY KEY,
    kind  TEXT  NOT NULL,
    key   TEXT  NOT NULL,
    op    TEXT  NOT NULL,
    value JSONB
);

CREATE INDEX IF NOT EXISTS felix_changes_kind_seq ON felix_changes (kind, seq);
