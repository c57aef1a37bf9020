//! One auditor's session on Postgres, as the read-only audit role.
//!
//! The endpoint speaks the extended query protocol to Postgres itself (over
//! the events crate's raw connection, built on `postgres-protocol`), so an
//! auditor's parameters and result formats pass through byte for byte and
//! Postgres does every type conversion. Each statement runs inside a
//! `REPEATABLE READ READ ONLY` transaction that the endpoint opened and whose
//! snapshot it already took (so `SET transaction_read_only = off` is refused),
//! and that it rolls back afterwards. An auditor's own `BEGIN` keeps that
//! transaction open until their `COMMIT` or `ROLLBACK`, so several statements
//! see one snapshot. Once out of it, every setting is reset to the
//! session's defaults, so an auditor cannot switch off the statement or idle
//! timeouts for later statements.

use bytes::{Bytes, BytesMut};
use events::replication::{ReplicationConnection, ReplicationError};
use fallible_iterator::FallibleIterator;
use pgwire::error::ErrorInfo;
use postgres_protocol::message::backend::{ErrorResponseBody, Message};
use postgres_protocol::message::frontend;
use postgres_protocol::IsNull;

/// A result column as Postgres described it.
#[derive(Debug, Clone)]
pub struct Column {
    pub name: String,
    pub table_oid: u32,
    pub column_id: i16,
    pub type_oid: u32,
    pub type_size: i16,
    pub type_modifier: i32,
}

/// A statement as Postgres described it.
#[derive(Debug, Clone)]
pub struct Described {
    pub params: Vec<u32>,
    pub columns: Vec<Column>,
}

/// What one statement did.
#[derive(Debug)]
pub enum Outcome {
    Rows {
        columns: Vec<Column>,
        rows: Vec<BytesMut>,
        tag: String,
    },
    Command {
        tag: String,
    },
    Empty,
    Error(Box<ErrorInfo>),
}

/// How a statement moved the auditor's transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxChange {
    None,
    Started,
    Ended,
}

/// A failure of the connection itself (not an SQL error).
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Connection(#[from] ReplicationError),
    #[error("protocol: {0}")]
    Protocol(String),
}

pub struct Backend {
    conn: ReplicationConnection,
    /// The auditor opened a transaction (their BEGIN) that is still open.
    in_client_tx: bool,
    max_result_bytes: usize,
}

const OPEN: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SELECT 1";
// After every statement outside an auditor's transaction, and when theirs
// ends: every setting back to the session's defaults (the endpoint's
// startup options and the role's settings, such as its statement and idle
// timeouts), whatever the auditor SET, and no session advisory lock left.
const CLOSE: &str = "ROLLBACK; RESET ALL; SELECT pg_advisory_unlock_all()";
const UNLOCK: &str = "RESET ALL; SELECT pg_advisory_unlock_all()";

impl Backend {
    pub async fn connect(
        config: &tokio_postgres::Config,
        options: &str,
        max_result_bytes: usize,
    ) -> Result<Backend, BackendError> {
        let conn =
            ReplicationConnection::connect_session(config, "strata-audit", Some(options)).await?;
        Ok(Backend {
            conn,
            in_client_tx: false,
            max_result_bytes,
        })
    }

    /// Parses `sql` (one statement) and describes its parameters and columns.
    pub async fn describe(
        &mut self,
        sql: &str,
        param_types: &[u32],
    ) -> Result<Result<Described, Box<ErrorInfo>>, BackendError> {
        let buf = self.conn.write_buf();
        frontend::parse("", sql, param_types.iter().copied(), buf).map_err(encode)?;
        frontend::describe(b'S', "", buf).map_err(encode)?;
        frontend::sync(buf);
        self.conn.flush().await?;
        let mut params = Vec::new();
        let mut columns = Vec::new();
        let mut error = None;
        loop {
            match self.conn.next_message().await? {
                Some(Message::ParameterDescription(body)) => {
                    params = body.parameters().collect().map_err(protocol)?;
                }
                Some(Message::RowDescription(body)) => columns = columns_of(&body)?,
                Some(Message::ErrorResponse(body)) => error = Some(error_info(&body)),
                Some(Message::ReadyForQuery(_)) => break,
                _ => {}
            }
        }
        Ok(match error {
            Some(e) => Err(e),
            None => Ok(Described { params, columns }),
        })
    }

    /// Runs one statement with the auditor's parameters and formats, inside
    /// the endpoint's read-only transaction.
    pub async fn execute(
        &mut self,
        sql: &str,
        param_types: &[u32],
        params: &[Option<Bytes>],
        param_formats: &[i16],
        result_formats: &[i16],
    ) -> Result<(Outcome, TxChange), BackendError> {
        if !self.in_client_tx {
            self.simple(OPEN).await?;
        }
        let buf = self.conn.write_buf();
        frontend::parse("", sql, param_types.iter().copied(), buf).map_err(encode)?;
        let bound = frontend::bind(
            "",
            "",
            param_formats.iter().copied(),
            params.iter(),
            |p, out| match p {
                Some(b) => {
                    out.extend_from_slice(b);
                    Ok(IsNull::No)
                }
                None => Ok(IsNull::Yes),
            },
            result_formats.iter().copied(),
            buf,
        );
        if bound.is_err() {
            return Err(BackendError::Protocol("could not encode Bind".into()));
        }
        frontend::describe(b'P', "", buf).map_err(encode)?;
        frontend::execute("", 0, buf).map_err(encode)?;
        frontend::sync(buf);
        self.conn.flush().await?;

        let mut columns = None;
        let mut rows = Vec::new();
        let mut bytes = 0usize;
        let mut outcome = None;
        let status;
        loop {
            match self.conn.next_message().await? {
                Some(Message::RowDescription(body)) => columns = Some(columns_of(&body)?),
                Some(Message::DataRow(body)) => {
                    bytes += body.buffer().len();
                    if bytes <= self.max_result_bytes {
                        rows.push(BytesMut::from(body.buffer()));
                    }
                }
                Some(Message::CommandComplete(_)) if outcome.is_some() => {
                    // A refused COPY ran to its end without its data.
                }
                Some(Message::CommandComplete(body)) => {
                    let tag = body.tag().map_err(protocol)?.to_string();
                    outcome = Some(match columns.take() {
                        Some(columns) => Outcome::Rows {
                            columns,
                            rows: std::mem::take(&mut rows),
                            tag,
                        },
                        None => Outcome::Command { tag },
                    });
                }
                Some(Message::EmptyQueryResponse) => outcome = Some(Outcome::Empty),
                Some(Message::ErrorResponse(body)) => {
                    outcome = Some(Outcome::Error(error_info(&body)))
                }
                Some(m @ (Message::CopyOutResponse(_) | Message::CopyInResponse(_))) => {
                    outcome = Some(Outcome::Error(Box::new(ErrorInfo::new(
                        "ERROR".into(),
                        "0A000".into(),
                        "COPY is not available through the audit endpoint; use SELECT".into(),
                    ))));
                    if let Message::CopyInResponse(_) = m {
                        // Postgres waits for data and ignores Sync until the copy ends.
                        let buf = self.conn.write_buf();
                        frontend::copy_fail("refused by the audit endpoint", buf)
                            .map_err(encode)?;
                        frontend::sync(buf);
                        self.conn.flush().await?;
                    }
                }
                Some(Message::ReadyForQuery(body)) => {
                    status = body.status();
                    break;
                }
                _ => {}
            }
        }
        let mut outcome = outcome.unwrap_or(Outcome::Empty);
        if bytes > self.max_result_bytes {
            outcome = Outcome::Error(Box::new(ErrorInfo::new(
                "ERROR".into(),
                "54000".into(),
                format!(
                    "the result is larger than the audit endpoint's limit of {} MiB; narrow the query (a position range, LIMIT)",
                    self.max_result_bytes >> 20
                ),
            )));
        }
        let began = matches!(&outcome, Outcome::Command { tag } if tag == "BEGIN" || tag == "START TRANSACTION");
        let change = match (self.in_client_tx, status) {
            (true, b'I') => TxChange::Ended,
            (false, b'T') if began => TxChange::Started,
            _ => TxChange::None,
        };
        self.in_client_tx = match change {
            TxChange::Started => true,
            TxChange::Ended => false,
            TxChange::None => self.in_client_tx,
        };
        if !self.in_client_tx {
            // Out of the auditor's transaction: end ours (if the statement
            // left it open) and drop any session advisory lock it took.
            self.simple(if status == b'I' { UNLOCK } else { CLOSE })
                .await?;
        }
        Ok((outcome, change))
    }

    /// Runs the endpoint's own statements; an error is a failure of the session.
    async fn simple(&mut self, sql: &str) -> Result<(), BackendError> {
        frontend::query(sql, self.conn.write_buf()).map_err(encode)?;
        self.conn.flush().await?;
        let mut error = None;
        loop {
            match self.conn.next_message().await? {
                Some(Message::ErrorResponse(body)) => {
                    error = Some(error_info(&body).message);
                }
                Some(Message::ReadyForQuery(_)) => break,
                _ => {}
            }
        }
        match error {
            Some(e) => Err(BackendError::Protocol(format!("{sql}: {e}"))),
            None => Ok(()),
        }
    }
}

fn encode(e: std::io::Error) -> BackendError {
    BackendError::Protocol(format!("encode: {e}"))
}

fn protocol(e: std::io::Error) -> BackendError {
    BackendError::Protocol(e.to_string())
}

fn columns_of(
    body: &postgres_protocol::message::backend::RowDescriptionBody,
) -> Result<Vec<Column>, BackendError> {
    body.fields()
        .map(|f| {
            Ok(Column {
                name: f.name().to_string(),
                table_oid: f.table_oid(),
                column_id: f.column_id(),
                type_oid: f.type_oid(),
                type_size: f.type_size(),
                type_modifier: f.type_modifier(),
            })
        })
        .collect()
        .map_err(protocol)
}

/// Postgres's error, field by field, for the auditor.
pub fn error_info(body: &ErrorResponseBody) -> Box<ErrorInfo> {
    let mut info = ErrorInfo::new("ERROR".into(), "XX000".into(), String::new());
    let mut fields = body.fields();
    while let Ok(Some(f)) = fields.next() {
        let v = String::from_utf8_lossy(f.value_bytes()).into_owned();
        match f.type_() {
            b'V' => info.severity = v,
            b'C' => info.code = v,
            b'M' => info.message = v,
            b'D' => info.detail = Some(v),
            b'H' => info.hint = Some(v),
            b'P' => info.position = Some(v),
            b'p' => info.internal_position = Some(v),
            b'q' => info.internal_query = Some(v),
            b'W' => info.where_context = Some(v),
            _ => {}
        }
    }
    Box::new(info)
}
