//! The two migration folders must produce the same schema: tables, columns
//! (type, nullability, order), primary keys, and indexes (columns,
//! uniqueness, partial predicate). A change to one folder without the other
//! fails here.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::*;
use sqlx::Connection;
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Column {
    name: String,
    ty: String,
    nullable: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Index {
    unique: bool,
    columns: Vec<String>,
    predicate: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Table {
    columns: Vec<Column>,
    primary_key: Vec<String>,
    indexes: BTreeMap<String, Index>,
}

type Schema = BTreeMap<String, Table>;

/// Type names as the migrations spell them, both sides lower-cased;
/// aliases mapped to one name.
fn normalize_type(t: &str) -> String {
    match t.trim().to_ascii_lowercase().as_str() {
        "int8" | "bigint" | "integer" => "bigint".into(),
        "bool" | "boolean" => "boolean".into(),
        "text" | "character varying" | "varchar" => "text".into(),
        other => other.into(),
    }
}

/// `(agent_id IS NULL)` / `agent_id IS NULL` → `agent_id is null`.
fn normalize_predicate(p: &str) -> String {
    p.chars()
        .filter(|c| !matches!(c, '(' | ')'))
        .collect::<String>()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_ascii_lowercase()
}

fn ours(table: &str) -> bool {
    !table.starts_with("_sqlx") && !table.starts_with("sqlite_")
}

async fn sqlite_schema(path: &std::path::Path) -> Schema {
    let mut c = sqlx::SqliteConnection::connect(&format!("sqlite:{}", path.display()))
        .await
        .unwrap();
    let tables: Vec<(String,)> =
        sqlx::query_as("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
            .fetch_all(&mut c)
            .await
            .unwrap();
    let mut schema = Schema::new();
    for (table,) in tables.into_iter().filter(|(t,)| ours(t)) {
        let cols: Vec<(i64, String, String, bool, i64)> = sqlx::query_as(
            "SELECT cid, name, type, \"notnull\", pk FROM pragma_table_info($1) ORDER BY cid",
        )
        .bind(&table)
        .fetch_all(&mut c)
        .await
        .unwrap();
        let mut t = Table::default();
        let mut pk: Vec<(i64, String)> = Vec::new();
        for (_, name, ty, notnull, pk_pos) in cols {
            if pk_pos > 0 {
                pk.push((pk_pos, name.clone()));
            }
            t.columns.push(Column {
                name,
                ty: normalize_type(&ty),
                nullable: !notnull,
            });
        }
        pk.sort();
        t.primary_key = pk.into_iter().map(|(_, n)| n).collect();
        let indexes: Vec<(String, bool, String)> = sqlx::query_as(
            "SELECT name, \"unique\", origin FROM pragma_index_list($1) ORDER BY name",
        )
        .bind(&table)
        .fetch_all(&mut c)
        .await
        .unwrap();
        for (name, unique, origin) in indexes {
            assert_ne!(
                origin, "u",
                "{table}: use CREATE UNIQUE INDEX with a name, not an inline UNIQUE constraint"
            );
            if origin == "pk" {
                continue;
            }
            let cols: Vec<(String,)> =
                sqlx::query_as("SELECT name FROM pragma_index_info($1) ORDER BY seqno")
                    .bind(&name)
                    .fetch_all(&mut c)
                    .await
                    .unwrap();
            let (sql,): (String,) =
                sqlx::query_as("SELECT sql FROM sqlite_master WHERE type = 'index' AND name = $1")
                    .bind(&name)
                    .fetch_one(&mut c)
                    .await
                    .unwrap();
            let upper = sql.to_ascii_uppercase();
            let predicate = upper
                .rfind(" WHERE ")
                .map(|at| normalize_predicate(&sql[at + 7..]));
            t.indexes.insert(
                name,
                Index {
                    unique,
                    columns: cols.into_iter().map(|(n,)| n).collect(),
                    predicate,
                },
            );
        }
        schema.insert(table, t);
    }
    schema
}

async fn postgres_schema(url: &str) -> Schema {
    let mut c = sqlx::PgConnection::connect(url).await.unwrap();
    let cols: Vec<(String, String, String, String)> = sqlx::query_as(
        "SELECT table_name::text, column_name::text, data_type::text, is_nullable::text \
         FROM information_schema.columns WHERE table_schema = 'public' \
         ORDER BY table_name, ordinal_position",
    )
    .fetch_all(&mut c)
    .await
    .unwrap();
    let mut schema = Schema::new();
    for (table, name, ty, nullable) in cols.into_iter().filter(|c| ours(&c.0)) {
        schema.entry(table).or_default().columns.push(Column {
            name,
            ty: normalize_type(&ty),
            nullable: nullable == "YES",
        });
    }
    /// table, index, primary, unique, columns, predicate
    type IndexRow = (String, String, bool, bool, Vec<String>, Option<String>);
    let indexes: Vec<IndexRow> = sqlx::query_as(
        "SELECT t.relname::text, i.relname::text, x.indisprimary, x.indisunique, \
                ARRAY(SELECT a.attname::text FROM unnest(x.indkey) WITH ORDINALITY AS k(attnum, ord) \
                      JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum ORDER BY k.ord), \
                pg_get_expr(x.indpred, x.indrelid) \
         FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class t ON t.oid = x.indrelid \
         JOIN pg_namespace n ON n.oid = t.relnamespace WHERE n.nspname = 'public'",
    )
    .fetch_all(&mut c)
    .await
    .unwrap();
    for (table, name, primary, unique, columns, predicate) in indexes {
        if !ours(&table) {
            continue;
        }
        let t = schema.get_mut(&table).unwrap();
        if primary {
            t.primary_key = columns;
        } else {
            t.indexes.insert(
                name,
                Index {
                    unique,
                    columns,
                    predicate: predicate.map(|p| normalize_predicate(&p)),
                },
            );
        }
    }
    schema
}

/// Every difference, one line each (empty: same schema).
fn diff(sqlite: &Schema, postgres: &Schema) -> Vec<String> {
    let mut out = Vec::new();
    for name in sqlite.keys().chain(postgres.keys()) {
        match (sqlite.get(name), postgres.get(name)) {
            (Some(a), Some(b)) => {
                if a.columns != b.columns {
                    out.push(format!(
                        "{name}: columns differ\n  sqlite:   {:?}\n  postgres: {:?}",
                        a.columns, b.columns
                    ));
                }
                if a.primary_key != b.primary_key {
                    out.push(format!(
                        "{name}: primary key {:?} vs {:?}",
                        a.primary_key, b.primary_key
                    ));
                }
                if a.indexes != b.indexes {
                    out.push(format!(
                        "{name}: indexes differ\n  sqlite:   {:?}\n  postgres: {:?}",
                        a.indexes, b.indexes
                    ));
                }
            }
            (Some(_), None) => out.push(format!("{name}: only in sqlite")),
            (None, Some(_)) => out.push(format!("{name}: only in postgres")),
            (None, None) => {}
        }
    }
    out.sort();
    out.dedup();
    out
}

#[tokio::test]
async fn sqlite_and_postgres_migrations_give_the_same_schema() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite_url = sqlite_url(&dir);
    let lite = open_fresh(&sqlite_url).await;
    lite.close().await;
    let db = TestDb::new().await;
    let pg = open_fresh(&db.url).await;
    pg.close().await;

    let kici_store::StoreUrl::Sqlite(path) = &sqlite_url else {
        unreachable!()
    };
    let a = sqlite_schema(path).await;
    let kici_store::StoreUrl::Postgres(pg_url) = &db.url else {
        unreachable!()
    };
    let b = postgres_schema(pg_url).await;
    db.drop_db().await;

    // The introspection found what the migrations declare.
    for table in [
        "agents",
        "events",
        "instances",
        "ip_leases",
        "ip_networks",
        "pending_requests",
    ] {
        assert!(a.contains_key(table) && b.contains_key(table), "{table}");
    }
    assert_eq!(a["ip_leases"].primary_key, ["network", "ip"]);
    assert_eq!(
        a["ip_leases"].indexes["ip_leases_free"]
            .predicate
            .as_deref(),
        Some("agent_id is null")
    );
    assert!(a["ip_leases"].indexes["ip_leases_agent"].unique);
    assert_eq!(a["agents"].columns.len(), 21, "{:?}", a["agents"].columns);

    let differences = diff(&a, &b);
    assert!(differences.is_empty(), "{}", differences.join("\n"));

    // And the comparison does see drift of each kind.
    let mut drift = b.clone();
    let job_id = &mut drift.get_mut("agents").unwrap().columns[8];
    assert_eq!((job_id.name.as_str(), job_id.nullable), ("job_id", true));
    job_id.nullable = false;
    assert_eq!(diff(&a, &drift).len(), 1);
    let mut drift = b.clone();
    drift.get_mut("agents").unwrap().columns[10].ty = "integer_flag".into();
    assert_eq!(diff(&a, &drift).len(), 1);
    let mut drift = b.clone();
    drift
        .get_mut("ip_leases")
        .unwrap()
        .indexes
        .get_mut("ip_leases_free")
        .unwrap()
        .predicate = None;
    assert_eq!(diff(&a, &drift).len(), 1);
    let mut drift = b.clone();
    drift.get_mut("events").unwrap().primary_key = vec!["seq".into()];
    assert_eq!(diff(&a, &drift).len(), 1);
    let mut drift = b;
    drift.remove("instances");
    assert_eq!(diff(&a, &drift), ["instances: only in sqlite"]);
}
