//! Statements that run the same directly and through a connection pooler in
//! transaction mode (PgBouncer 1.18 and older keep no prepared statement
//! across transactions).
//!
//! tokio-postgres' `query`/`execute` first prepare a *named* statement
//! (`s0`, `s1`, ...) and run it in a second exchange. Behind a pooler the
//! two exchanges can land on different server connections (`prepared
//! statement "s0" does not exist`), and a name left behind on a server
//! connection collides with the next client's (`prepared statement "s0"
//! already exists`). [`Sql`]'s methods send one unnamed statement with its
//! parameters' types (Parse, Bind, Execute, Sync in one exchange), so nothing
//! outlives the statement; they also save the round trip of preparing.
//!
//! Parameters are anything [`Param`]: the Rust types Strata binds, each with
//! the PostgreSQL type it is sent as.

use std::future::Future;
use std::time::SystemTime;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Error, GenericClient, Row};

/// A value bound as a statement parameter, with the type it is sent as.
pub trait Param: ToSql + Sync {
    /// The PostgreSQL type this value is sent as.
    fn pg_type(&self) -> Type;
    /// The value as tokio-postgres takes it.
    fn as_sql(&self) -> &(dyn ToSql + Sync);
}

/// A Rust type with one PostgreSQL type (so that `Option<T>` has one too).
pub trait Typed {
    /// The PostgreSQL type values of this type are sent as.
    fn pg() -> Type;
}

impl<T: Typed + ToSql + Sync> Param for T {
    fn pg_type(&self) -> Type {
        T::pg()
    }
    fn as_sql(&self) -> &(dyn ToSql + Sync) {
        self
    }
}

macro_rules! typed {
    ($($t:ty => $pg:ident),* $(,)?) => {
        $(impl Typed for $t {
            fn pg() -> Type {
                Type::$pg
            }
        })*
    };
}

typed! {
    bool => BOOL,
    i16 => INT2,
    i32 => INT4,
    i64 => INT8,
    f64 => FLOAT8,
    String => TEXT,
    &str => TEXT,
    Vec<u8> => BYTEA,
    &[u8] => BYTEA,
    SystemTime => TIMESTAMPTZ,
    serde_json::Value => JSONB,
    Vec<String> => TEXT_ARRAY,
    Vec<&str> => TEXT_ARRAY,
    &[String] => TEXT_ARRAY,
    &[&str] => TEXT_ARRAY,
    Vec<i64> => INT8_ARRAY,
    &[i64] => INT8_ARRAY,
    Vec<i32> => INT4_ARRAY,
    Vec<bool> => BOOL_ARRAY,
    Vec<Vec<u8>> => BYTEA_ARRAY,
    Vec<serde_json::Value> => JSONB_ARRAY,
    Vec<SystemTime> => TIMESTAMPTZ_ARRAY,
    Vec<Option<String>> => TEXT_ARRAY,
    Vec<Option<i64>> => INT8_ARRAY,
}

impl<T: Typed> Typed for Option<T> {
    fn pg() -> Type {
        T::pg()
    }
}

impl<T: Typed> Typed for &T {
    fn pg() -> Type {
        T::pg()
    }
}

impl<T: serde::Serialize> Typed for tokio_postgres::types::Json<T> {
    fn pg() -> Type {
        Type::JSONB
    }
}

impl<T: serde::Serialize> Typed for Vec<tokio_postgres::types::Json<T>> {
    fn pg() -> Type {
        Type::JSONB_ARRAY
    }
}

fn typed<'a>(params: &'a [&'a dyn Param]) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
    params.iter().map(|p| (p.as_sql(), p.pg_type())).collect()
}

/// Unnamed, typed statements on a client or in a transaction (see the
/// module's docs for why).
pub trait Sql: Sync {
    /// Runs a statement and returns its rows.
    fn rows(
        &self,
        sql: &str,
        params: &[&dyn Param],
    ) -> impl Future<Output = Result<Vec<Row>, Error>> + Send;

    /// Runs a statement that returns exactly one row.
    fn one(
        &self,
        sql: &str,
        params: &[&dyn Param],
    ) -> impl Future<Output = Result<Row, Error>> + Send;

    /// Runs a statement that returns at most one row.
    fn opt(
        &self,
        sql: &str,
        params: &[&dyn Param],
    ) -> impl Future<Output = Result<Option<Row>, Error>> + Send;

    /// Runs a statement and returns how many rows it changed.
    fn exec(
        &self,
        sql: &str,
        params: &[&dyn Param],
    ) -> impl Future<Output = Result<u64, Error>> + Send;
}

impl<C: GenericClient + Sync> Sql for C {
    fn rows(
        &self,
        sql: &str,
        params: &[&dyn Param],
    ) -> impl Future<Output = Result<Vec<Row>, Error>> + Send {
        let p = typed(params);
        async move { self.query_typed(sql, &p).await }
    }

    fn one(
        &self,
        sql: &str,
        params: &[&dyn Param],
    ) -> impl Future<Output = Result<Row, Error>> + Send {
        let p = typed(params);
        async move { self.query_typed_one(sql, &p).await }
    }

    fn opt(
        &self,
        sql: &str,
        params: &[&dyn Param],
    ) -> impl Future<Output = Result<Option<Row>, Error>> + Send {
        let p = typed(params);
        async move { self.query_typed_opt(sql, &p).await }
    }

    fn exec(
        &self,
        sql: &str,
        params: &[&dyn Param],
    ) -> impl Future<Output = Result<u64, Error>> + Send {
        let p = typed(params);
        async move {
            use futures_util::TryStreamExt;
            let stream = self.query_typed_raw(sql, p).await?;
            futures_util::pin_mut!(stream);
            while stream.try_next().await?.is_some() {}
            Ok(stream.rows_affected().unwrap_or(0))
        }
    }
}
