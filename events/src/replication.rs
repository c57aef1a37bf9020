//! A logical replication connection, built on `postgres-protocol`'s message
//! encoders, authentication (SCRAM-SHA-256, MD5, cleartext) and backend
//! parser. `tokio-postgres` has no replication mode, so this speaks the
//! streaming replication protocol itself:
//!
//! ```text
//!  startup(replication=database) -> auth -> IDENTIFY_SYSTEM
//!    -> CREATE_REPLICATION_SLOT s [TEMPORARY] LOGICAL pgoutput (SNAPSHOT 'export')
//!    -> START_REPLICATION SLOT s LOGICAL lsn (proto_version '1', publication_names 'p', binary 'true')
//!    <- CopyBoth: XLogData / keepalives ... -> standby status updates
//! ```
//!
//! Frames are read with an explicit length bound, so a corrupt or hostile
//! length cannot make us allocate without limit.

use crate::db::Database;
use crate::pgoutput::{self, DecodeError, ReplicationMessage};
use crate::pgtls::SslMode;
use crate::types::Lsn;
use crate::ErrorKind;
use bytes::{Buf, BytesMut};
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256, SCRAM_SHA_256};
use postgres_protocol::message::backend::{Header, Message};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_postgres::config::Host;
use tokio_postgres::Config;

/// Largest backend message accepted (a transaction's single row is far smaller).
pub const MAX_FRAME: usize = 256 << 20;

/// Errors of the replication connection.
#[derive(Debug, thiserror::Error)]
pub enum ReplicationError {
    #[error("{context}: {source}")]
    Io {
        context: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("server error {code} during {context}: {message}")]
    Server {
        context: &'static str,
        code: String,
        message: String,
    },
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("authentication failed: {0}")]
    Auth(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// TLS could not be set up: the server declined it where the mode
    /// requires it, or its certificate was refused.
    #[error("TLS: {0}")]
    Tls(String),
    /// The server is read-only (a standby) and the URL asks for
    /// `target_session_attrs=read-write`: the next host is tried, and the
    /// whole list again later.
    #[error("the server at {0} is read-only (a standby?) and target_session_attrs=read-write")]
    ReadOnly(String),
    /// The slot lost WAL it needed (`wal_status = lost`): it can no longer
    /// deliver everything after its confirmed position.
    #[error("replication slot {slot:?} was invalidated: its WAL was removed (wal_status = lost); the log must be read from the table")]
    SlotInvalidated { slot: String },
    /// The slot confirmed more than the consumer says it made durable:
    /// transactions between the two would be skipped.
    #[error("replication slot {slot:?} is ahead of the resume point: slot confirmed {confirmed}, consumer needs {requested}; the events between must be read from the table")]
    SlotAhead {
        slot: String,
        confirmed: Lsn,
        requested: Lsn,
    },
    #[error("the server closed the replication connection")]
    Closed,
}

impl ReplicationError {
    /// Transient or definite; exhaustive so that no new variant goes unclassified.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ReplicationError::Io { .. }
            | ReplicationError::Closed
            | ReplicationError::ReadOnly(_) => ErrorKind::Transient,
            ReplicationError::Server { code, .. } => {
                let c = code.as_str();
                // 55006 object_in_use: the slot is still held by a walsender
                // that has not noticed its client went away.
                if c.starts_with("08")
                    || c.starts_with("40")
                    || c.starts_with("53")
                    || c.starts_with("57")
                    || c == "55006"
                {
                    ErrorKind::Transient
                } else {
                    ErrorKind::Definite
                }
            }
            ReplicationError::Protocol(_)
            | ReplicationError::Decode(_)
            | ReplicationError::Auth(_)
            | ReplicationError::Unsupported(_)
            | ReplicationError::Tls(_)
            | ReplicationError::SlotInvalidated { .. }
            | ReplicationError::SlotAhead { .. } => ErrorKind::Definite,
        }
    }
}

fn io(context: &'static str) -> impl FnOnce(std::io::Error) -> ReplicationError {
    move |source| ReplicationError::Io { context, source }
}

trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// Asks for TLS as the database's `sslmode` says (an `SSLRequest`, then the
/// handshake); a server that declines is refused unless the mode lets the
/// session go on in the clear.
async fn negotiate_tls(
    db: &Database,
    host: &str,
    mut tcp: tokio::net::TcpStream,
) -> Result<Box<dyn Stream>, ReplicationError> {
    let mode = db.tls.settings.mode;
    if mode == SslMode::Disable {
        return Ok(Box::new(tcp));
    }
    let mut buf = BytesMut::with_capacity(8);
    frontend::ssl_request(&mut buf);
    tcp.write_all(&buf).await.map_err(io("ask for TLS"))?;
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer)
        .await
        .map_err(io("read the answer to the TLS request"))?;
    match answer[0] {
        b'S' => {
            let name = crate::pgtls::server_name(host).map_err(io("TLS server name"))?;
            let tls = tokio_rustls::TlsConnector::from(db.tls.client_config())
                .connect(name, tcp)
                .await
                .map_err(|e| ReplicationError::Tls(format!("handshake with {host}: {e}")))?;
            Ok(Box::new(tls))
        }
        b'N' if !mode.requires_tls() => Ok(Box::new(tcp)),
        b'N' => Err(ReplicationError::Tls(format!(
            "the server at {host} does not accept TLS and sslmode={} requires it",
            mode.as_str()
        ))),
        other => Err(ReplicationError::Protocol(format!(
            "unexpected answer {other:#x} to the TLS request"
        ))),
    }
}

/// What IDENTIFY_SYSTEM reports.
#[derive(Debug, Clone)]
pub struct SystemInfo {
    pub system_id: String,
    pub timeline: u32,
    pub xlogpos: Lsn,
    pub dbname: Option<String>,
}

/// A slot just created.
#[derive(Debug, Clone)]
pub struct CreatedSlot {
    pub name: String,
    pub consistent_point: Lsn,
    /// The exported snapshot, valid until this connection runs its next command.
    pub snapshot: Option<String>,
}

/// A connection in replication mode.
pub struct ReplicationConnection {
    stream: Box<dyn Stream>,
    rbuf: BytesMut,
    wbuf: BytesMut,
    /// The server process's id and cancel key (BackendKeyData).
    key: Option<(i32, i32)>,
}

/// One frame's payload from the replication stream.
pub enum Frame {
    Data(bytes::Bytes),
    /// The server ended the copy (CopyDone).
    Done,
}

/// Asks the server at the first host of `config` to cancel what the process
/// `pid` is running (a CancelRequest with its key, on a connection of its
/// own, as the protocol has it). The server answers nothing.
pub async fn cancel(config: &Config, pid: i32, key: i32) -> Result<(), ReplicationError> {
    use tokio::io::AsyncWriteExt;
    let host =
        config.get_hosts().first().cloned().ok_or_else(|| {
            ReplicationError::Unsupported("the database URL names no host".into())
        })?;
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let mut buf = BytesMut::with_capacity(16);
    frontend::cancel_request(pid, key, &mut buf);
    let mut stream: Box<dyn Stream> = match host {
        Host::Tcp(h) => Box::new(
            tokio::net::TcpStream::connect((h.as_str(), port))
                .await
                .map_err(io("connect to cancel"))?,
        ),
        Host::Unix(dir) => Box::new(
            tokio::net::UnixStream::connect(dir.join(format!(".s.PGSQL.{port}")))
                .await
                .map_err(io("connect to cancel"))?,
        ),
    };
    stream.write_all(&buf).await.map_err(io("send cancel"))?;
    stream.flush().await.map_err(io("send cancel"))?;
    Ok(())
}

impl ReplicationConnection {
    /// Connects in `replication=database` mode to the first of the
    /// database's hosts that takes the connection; always to the server
    /// itself ([`Database::direct`]), as no pooler carries replication.
    pub async fn connect(
        db: impl Into<Database>,
        application_name: &str,
    ) -> Result<Self, ReplicationError> {
        let db = db.into();
        Self::connect_mode(db.direct(), application_name, Some("database"), None).await
    }

    /// Connects as a plain session (no replication), with `options` as the
    /// startup `options` parameter (`-c name=value ...`). For callers that
    /// speak the extended query protocol themselves with
    /// [`Self::write_buf`], [`Self::flush`] and [`Self::next_message`].
    pub async fn connect_session(
        db: impl Into<Database>,
        application_name: &str,
        options: Option<&str>,
    ) -> Result<Self, ReplicationError> {
        Self::connect_mode(&db.into(), application_name, None, options).await
    }

    /// Each host in turn (libpq's order) until one takes the connection;
    /// the last host's error if none does.
    async fn connect_mode(
        db: &Database,
        application_name: &str,
        replication: Option<&str>,
        options: Option<&str>,
    ) -> Result<Self, ReplicationError> {
        let config = &db.config;
        let hosts = config.get_hosts();
        if hosts.is_empty() {
            return Err(ReplicationError::Unsupported(
                "the database URL names no host".into(),
            ));
        }
        let ports = config.get_ports();
        let mut last = None;
        for (i, host) in hosts.iter().enumerate() {
            let port = match ports {
                [] => 5432,
                [p] => *p,
                many => many.get(i).copied().unwrap_or(5432),
            };
            match Self::connect_host(db, host, port, application_name, replication, options).await {
                Ok(c) => return Ok(c),
                Err(e) => {
                    tracing::debug!(host = ?host, port, error = %e, "replication connection to this host failed");
                    last = Some(e);
                }
            }
        }
        Err(last.expect("at least one host was tried"))
    }

    async fn connect_host(
        db: &Database,
        host: &Host,
        port: u16,
        application_name: &str,
        replication: Option<&str>,
        options: Option<&str>,
    ) -> Result<Self, ReplicationError> {
        let config = &db.config;
        let timeout = db.connect_timeout();
        let timed_out = || ReplicationError::Io {
            context: "connect for replication",
            source: std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"),
        };
        let stream: Box<dyn Stream> = match host {
            Host::Tcp(h) => {
                let s = tokio::time::timeout(
                    timeout,
                    tokio::net::TcpStream::connect((h.as_str(), port)),
                )
                .await
                .map_err(|_| timed_out())?
                .map_err(io("connect for replication"))?;
                s.set_nodelay(true).map_err(io("set TCP_NODELAY"))?;
                tokio::time::timeout(timeout, negotiate_tls(db, h, s))
                    .await
                    .map_err(|_| timed_out())??
            }
            // As libpq: no TLS over a Unix-domain socket.
            Host::Unix(dir) => {
                let path = dir.join(format!(".s.PGSQL.{port}"));
                Box::new(
                    tokio::net::UnixStream::connect(path)
                        .await
                        .map_err(io("connect for replication"))?,
                )
            }
        };
        let mut conn = ReplicationConnection {
            stream,
            rbuf: BytesMut::with_capacity(64 * 1024),
            wbuf: BytesMut::with_capacity(1024),
            key: None,
        };
        // The start-up exchange is bounded like the socket's connect: a
        // stopped server takes the connection into its backlog and answers
        // nothing.
        tokio::time::timeout(
            timeout,
            conn.startup(config, application_name, replication, options),
        )
        .await
        .map_err(|_| timed_out())??;
        // As libpq: with target_session_attrs=read-write a server that is
        // read-only (a standby not yet promoted) is passed over.
        if config.get_target_session_attrs()
            == tokio_postgres::config::TargetSessionAttrs::ReadWrite
        {
            let rows =
                tokio::time::timeout(timeout, conn.simple_query("SHOW transaction_read_only"))
                    .await
                    .map_err(|_| timed_out())??;
            let read_only = rows
                .first()
                .and_then(|r| r.first().cloned().flatten())
                .is_some_and(|v| v == "on");
            if read_only {
                return Err(ReplicationError::ReadOnly(format!("{host:?} port {port}")));
            }
        }
        Ok(conn)
    }

    async fn startup(
        &mut self,
        config: &Config,
        application_name: &str,
        replication: Option<&str>,
        options: Option<&str>,
    ) -> Result<(), ReplicationError> {
        let user = config
            .get_user()
            .ok_or_else(|| ReplicationError::Unsupported("the database URL names no user".into()))?
            .to_string();
        let dbname = config.get_dbname().unwrap_or(&user).to_string();
        let mut params = vec![
            ("user", user.as_str()),
            ("database", dbname.as_str()),
            ("application_name", application_name),
            ("client_encoding", "UTF8"),
        ];
        if let Some(r) = replication {
            params.push(("replication", r));
        }
        if let Some(o) = options {
            params.push(("options", o));
        }
        frontend::startup_message(params.iter().copied(), &mut self.wbuf)
            .map_err(io("encode startup"))?;
        self.flush().await?;
        let password = config.get_password().map(<[u8]>::to_vec);
        let mut scram: Option<ScramSha256> = None;
        loop {
            match self.read_message("start up").await? {
                Message::AuthenticationOk => {}
                Message::AuthenticationCleartextPassword => {
                    let pw = password.as_deref().ok_or_else(|| {
                        ReplicationError::Auth(
                            "the server asks for a password and none was given".into(),
                        )
                    })?;
                    frontend::password_message(pw, &mut self.wbuf)
                        .map_err(io("encode password"))?;
                    self.flush().await?;
                }
                Message::AuthenticationMd5Password(body) => {
                    let pw = password.as_deref().ok_or_else(|| {
                        ReplicationError::Auth(
                            "the server asks for a password and none was given".into(),
                        )
                    })?;
                    let hash = postgres_protocol::authentication::md5_hash(
                        user.as_bytes(),
                        pw,
                        body.salt(),
                    );
                    frontend::password_message(hash.as_bytes(), &mut self.wbuf)
                        .map_err(io("encode password"))?;
                    self.flush().await?;
                }
                Message::AuthenticationSasl(body) => {
                    let pw = password.as_deref().ok_or_else(|| {
                        ReplicationError::Auth(
                            "the server asks for a password and none was given".into(),
                        )
                    })?;
                    let mut mechs = body.mechanisms();
                    let mut ok = false;
                    while let Some(m) = fallible_iterator::FallibleIterator::next(&mut mechs)
                        .map_err(io("read SASL mechanisms"))?
                    {
                        ok |= m == SCRAM_SHA_256;
                    }
                    if !ok {
                        return Err(ReplicationError::Auth(
                            "the server offers no SASL mechanism we support".into(),
                        ));
                    }
                    let s = ScramSha256::new(pw, ChannelBinding::unsupported());
                    frontend::sasl_initial_response(SCRAM_SHA_256, s.message(), &mut self.wbuf)
                        .map_err(io("encode SASL"))?;
                    self.flush().await?;
                    scram = Some(s);
                }
                Message::AuthenticationSaslContinue(body) => {
                    let s = scram.as_mut().ok_or_else(|| {
                        ReplicationError::Protocol("SASL continue before SASL start".into())
                    })?;
                    s.update(body.data())
                        .map_err(|e| ReplicationError::Auth(e.to_string()))?;
                    frontend::sasl_response(s.message(), &mut self.wbuf)
                        .map_err(io("encode SASL"))?;
                    self.flush().await?;
                }
                Message::AuthenticationSaslFinal(body) => {
                    let s = scram.as_mut().ok_or_else(|| {
                        ReplicationError::Protocol("SASL final before SASL start".into())
                    })?;
                    s.finish(body.data())
                        .map_err(|e| ReplicationError::Auth(e.to_string()))?;
                }
                Message::ErrorResponse(body) => return Err(server_error("start up", &body)),
                Message::ReadyForQuery(_) => return Ok(()),
                Message::BackendKeyData(body) => {
                    self.key = Some((body.process_id(), body.secret_key()));
                }
                Message::ParameterStatus(_) | Message::NoticeResponse(_) => {}
                Message::AuthenticationGss
                | Message::AuthenticationSspi
                | Message::AuthenticationKerberosV5
                | Message::AuthenticationScmCredential => {
                    return Err(ReplicationError::Auth(
                        "the server asks for an authentication method we do not support".into(),
                    ));
                }
                _ => {
                    return Err(ReplicationError::Protocol(
                        "unexpected message during start-up".into(),
                    ))
                }
            }
        }
    }

    /// The server process's id and cancel key, as it sent them at start-up.
    /// Closes the connection (a FIN to the server): what it was doing is
    /// abandoned, and the connection is not to be used again.
    pub async fn close(&mut self) {
        use tokio::io::AsyncWriteExt;
        let _ = self.stream.shutdown().await;
    }

    pub fn backend_key(&self) -> Option<(i32, i32)> {
        self.key
    }

    /// The buffer of frontend messages not yet sent; [`Self::flush`] sends it.
    pub fn write_buf(&mut self) -> &mut BytesMut {
        &mut self.wbuf
    }

    /// The next backend message, or `None` for a COPY data frame (skipped).
    pub async fn next_message(&mut self) -> Result<Option<Message>, ReplicationError> {
        let (tag, total) = self.fill_frame("read from postgres").await?;
        if matches!(tag, b'W' | b'd' | b'c') {
            self.rbuf.advance(total);
            return Ok(None);
        }
        Message::parse(&mut self.rbuf)
            .map_err(|e| ReplicationError::Protocol(e.to_string()))?
            .map(Some)
            .ok_or_else(|| ReplicationError::Protocol("incomplete message".into()))
    }

    /// Starts `COPY ... TO STDOUT` (a plain session); read its data with
    /// [`Self::copy_data`].
    pub async fn copy_out_start(&mut self, sql: &str) -> Result<(), ReplicationError> {
        frontend::query(sql, &mut self.wbuf).map_err(io("encode COPY"))?;
        self.flush().await?;
        loop {
            match self.next_message().await? {
                Some(Message::CopyOutResponse(_)) => return Ok(()),
                Some(Message::ErrorResponse(body)) => return Err(self.failed_copy(&body).await),
                Some(Message::ReadyForQuery(_)) => {
                    return Err(ReplicationError::Protocol(
                        "the statement did not start a COPY".into(),
                    ))
                }
                _ => {}
            }
        }
    }

    /// The server's error for a COPY, after reading on to ReadyForQuery so
    /// the connection stays usable.
    async fn failed_copy(
        &mut self,
        body: &postgres_protocol::message::backend::ErrorResponseBody,
    ) -> ReplicationError {
        let e = server_error("COPY", body);
        loop {
            match self.next_message().await {
                Ok(Some(Message::ReadyForQuery(_))) => return e,
                Ok(_) => {}
                Err(read) => return read,
            }
        }
    }

    /// Hands every complete CopyData payload in the buffer to `f` (reading
    /// from the socket when none is complete). Returns `false` once the COPY
    /// has ended (CopyDone, CommandComplete and ReadyForQuery read). Whole
    /// buffers are processed at a time, without a copy per row.
    pub async fn copy_data<E: From<ReplicationError>>(
        &mut self,
        mut f: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<bool, E> {
        loop {
            let mut used = 0usize;
            let mut progressed = false;
            loop {
                let rest = &self.rbuf[used..];
                if rest.len() < 5 {
                    break;
                }
                let tag = rest[0];
                let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
                if len < 4 || len + 1 > MAX_FRAME {
                    return Err(
                        ReplicationError::Protocol(format!("COPY frame of {len} bytes")).into(),
                    );
                }
                if rest.len() < len + 1 {
                    break;
                }
                if tag != b'd' {
                    break;
                }
                f(&rest[5..len + 1])?;
                used += len + 1;
                progressed = true;
            }
            self.rbuf.advance(used);
            if progressed {
                return Ok(true);
            }
            // Not a complete CopyData frame: another message, or more bytes.
            if self.rbuf.len() >= 5 && self.rbuf[0] != b'd' {
                let len =
                    u32::from_be_bytes([self.rbuf[1], self.rbuf[2], self.rbuf[3], self.rbuf[4]])
                        as usize;
                if self.rbuf.len() > len {
                    match self.next_message().await? {
                        Some(Message::ReadyForQuery(_)) => return Ok(false),
                        Some(Message::ErrorResponse(body)) => {
                            return Err(self.failed_copy(&body).await.into())
                        }
                        _ => continue,
                    }
                }
            }
            if self.rbuf.capacity() - self.rbuf.len() < 64 * 1024 {
                self.rbuf.reserve(256 * 1024);
            }
            let n = self
                .stream
                .read_buf(&mut self.rbuf)
                .await
                .map_err(io("read COPY data"))?;
            if n == 0 {
                return Err(ReplicationError::Closed.into());
            }
        }
    }

    pub async fn flush(&mut self) -> Result<(), ReplicationError> {
        self.stream
            .write_all(&self.wbuf)
            .await
            .map_err(io("write to postgres"))?;
        self.stream.flush().await.map_err(io("write to postgres"))?;
        self.wbuf.clear();
        Ok(())
    }

    /// Reads one complete frame into `rbuf`; returns its tag and length. Cancel
    /// safe: bytes stay in the buffer until a whole frame is there.
    async fn fill_frame(&mut self, context: &'static str) -> Result<(u8, usize), ReplicationError> {
        loop {
            if let Some(h) =
                Header::parse(&self.rbuf).map_err(|e| ReplicationError::Protocol(e.to_string()))?
            {
                let total = h.len() as usize + 1;
                if total > MAX_FRAME {
                    return Err(ReplicationError::Protocol(format!(
                        "message of {total} bytes exceeds the limit of {MAX_FRAME}"
                    )));
                }
                if self.rbuf.len() >= total {
                    return Ok((h.tag(), total));
                }
                self.rbuf.reserve(total - self.rbuf.len());
            }
            let n = self
                .stream
                .read_buf(&mut self.rbuf)
                .await
                .map_err(io(context))?;
            if n == 0 {
                return Err(ReplicationError::Closed);
            }
        }
    }

    async fn read_message(&mut self, context: &'static str) -> Result<Message, ReplicationError> {
        let (tag, total) = self.fill_frame(context).await?;
        if matches!(tag, b'W' | b'd' | b'c') {
            // Copy traffic belongs to `start` and `recv`; postgres-protocol
            // does not parse CopyBothResponse at all.
            self.rbuf.advance(total);
            return Err(ReplicationError::Protocol(format!(
                "unexpected copy message {:?} during {context}",
                tag as char
            )));
        }
        Message::parse(&mut self.rbuf)
            .map_err(|e| ReplicationError::Protocol(e.to_string()))?
            .ok_or_else(|| ReplicationError::Protocol("incomplete message".into()))
    }

    /// Runs a simple query and returns its rows as text.
    pub async fn simple_query(
        &mut self,
        sql: &str,
    ) -> Result<Vec<Vec<Option<String>>>, ReplicationError> {
        frontend::query(sql, &mut self.wbuf).map_err(io("encode query"))?;
        self.flush().await?;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            match self.read_message("run a replication command").await? {
                Message::DataRow(body) => {
                    let buf = body.buffer();
                    let mut row = Vec::new();
                    let mut ranges = body.ranges();
                    while let Some(r) = fallible_iterator::FallibleIterator::next(&mut ranges)
                        .map_err(|e| ReplicationError::Protocol(e.to_string()))?
                    {
                        row.push(r.map(|r| {
                            String::from_utf8_lossy(buf.get(r).unwrap_or_default()).into_owned()
                        }));
                    }
                    rows.push(row);
                }
                Message::ErrorResponse(body) => {
                    error = Some(server_error("a replication command", &body))
                }
                Message::ReadyForQuery(_) => {
                    return match error {
                        Some(e) => Err(e),
                        None => Ok(rows),
                    }
                }
                _ => {}
            }
        }
    }

    /// IDENTIFY_SYSTEM.
    pub async fn identify_system(&mut self) -> Result<SystemInfo, ReplicationError> {
        let rows = self.simple_query("IDENTIFY_SYSTEM").await?;
        let row = rows
            .first()
            .ok_or_else(|| ReplicationError::Protocol("IDENTIFY_SYSTEM returned no row".into()))?;
        let col = |i: usize| row.get(i).cloned().flatten();
        Ok(SystemInfo {
            system_id: col(0).unwrap_or_default(),
            timeline: col(1).and_then(|t| t.parse().ok()).unwrap_or(0),
            xlogpos: col(2).and_then(|l| l.parse().ok()).ok_or_else(|| {
                ReplicationError::Protocol("IDENTIFY_SYSTEM returned no xlogpos".into())
            })?,
            dbname: col(3),
        })
    }

    /// CREATE_REPLICATION_SLOT for pgoutput, exporting a snapshot when asked.
    pub async fn create_slot(
        &mut self,
        name: &str,
        temporary: bool,
        export_snapshot: bool,
    ) -> Result<CreatedSlot, ReplicationError> {
        check_ident(name)?;
        let sql = format!(
            "CREATE_REPLICATION_SLOT {name} {}LOGICAL pgoutput {}",
            if temporary { "TEMPORARY " } else { "" },
            if export_snapshot {
                "(SNAPSHOT 'export')"
            } else {
                "(SNAPSHOT 'nothing')"
            }
        );
        let rows = self.simple_query(&sql).await?;
        let row = rows.first().ok_or_else(|| {
            ReplicationError::Protocol("CREATE_REPLICATION_SLOT returned no row".into())
        })?;
        Ok(CreatedSlot {
            name: row.first().cloned().flatten().unwrap_or_default(),
            consistent_point: row
                .get(1)
                .cloned()
                .flatten()
                .and_then(|l| l.parse().ok())
                .ok_or_else(|| {
                    ReplicationError::Protocol(
                        "CREATE_REPLICATION_SLOT returned no consistent point".into(),
                    )
                })?,
            snapshot: row.get(2).cloned().flatten(),
        })
    }

    /// START_REPLICATION with pgoutput in binary mode. `start` of zero lets
    /// the server start at the slot's confirmed position.
    pub async fn start(
        &mut self,
        slot: &str,
        start: Lsn,
        publication: &str,
    ) -> Result<(), ReplicationError> {
        check_ident(slot)?;
        check_ident(publication)?;
        let sql = format!(
            "START_REPLICATION SLOT {slot} LOGICAL {start} (\"proto_version\" '1', \"publication_names\" '{publication}', \"binary\" 'true')"
        );
        frontend::query(&sql, &mut self.wbuf).map_err(io("encode START_REPLICATION"))?;
        self.flush().await?;
        loop {
            let (tag, total) = self.fill_frame("start replication").await?;
            match tag {
                b'W' => {
                    self.rbuf.advance(total);
                    return Ok(());
                }
                b'E' => {
                    let msg = Message::parse(&mut self.rbuf)
                        .map_err(|e| ReplicationError::Protocol(e.to_string()))?;
                    if let Some(Message::ErrorResponse(body)) = msg {
                        return Err(server_error("START_REPLICATION", &body));
                    }
                }
                b'N' | b'S' => self.rbuf.advance(total),
                _ => {
                    return Err(ReplicationError::Protocol(format!(
                        "unexpected message {:?} after START_REPLICATION",
                        tag as char
                    )))
                }
            }
        }
    }

    /// The next CopyData payload of the replication stream. Cancel safe.
    pub async fn recv(&mut self) -> Result<Frame, ReplicationError> {
        loop {
            let (tag, total) = self.fill_frame("read the replication stream").await?;
            match tag {
                b'd' => {
                    let mut frame = self.rbuf.split_to(total);
                    frame.advance(5);
                    return Ok(Frame::Data(frame.freeze()));
                }
                // CopyDone, or the CommandComplete/ReadyForQuery after it: the
                // server ended the stream (e.g. it is shutting down).
                b'c' | b'C' | b'Z' => {
                    self.rbuf.advance(total);
                    return Ok(Frame::Done);
                }
                b'E' => {
                    let msg = Message::parse(&mut self.rbuf)
                        .map_err(|e| ReplicationError::Protocol(e.to_string()))?;
                    if let Some(Message::ErrorResponse(body)) = msg {
                        return Err(server_error("streaming", &body));
                    }
                    return Err(ReplicationError::Protocol("bad error message".into()));
                }
                // Notices and parameter changes can arrive at any time.
                b'N' | b'S' => self.rbuf.advance(total),
                _ => {
                    return Err(ReplicationError::Protocol(format!(
                        "unexpected message {:?} in the replication stream",
                        tag as char
                    )))
                }
            }
        }
    }

    /// Sends a standby status update: everything up to `flush` is durable.
    pub async fn send_status(
        &mut self,
        write: Lsn,
        flush: Lsn,
        reply: bool,
    ) -> Result<(), ReplicationError> {
        let clock = crate::types::to_pg_time(std::time::SystemTime::now());
        let msg = pgoutput::encode_status(write, flush, flush, clock, reply);
        let data = frontend::CopyData::new(&msg[..]).map_err(io("encode status update"))?;
        data.write(&mut self.wbuf);
        self.flush().await
    }
}

/// Decodes one frame's payload.
pub fn decode(frame: &[u8]) -> Result<ReplicationMessage<'_>, DecodeError> {
    pgoutput::decode_replication(frame)
}

fn server_error(
    context: &'static str,
    body: &postgres_protocol::message::backend::ErrorResponseBody,
) -> ReplicationError {
    let mut code = String::new();
    let mut message = String::new();
    let mut fields = body.fields();
    while let Ok(Some(f)) = fallible_iterator::FallibleIterator::next(&mut fields) {
        match f.type_() {
            b'C' => code = String::from_utf8_lossy(f.value_bytes()).into_owned(),
            b'M' => message = String::from_utf8_lossy(f.value_bytes()).into_owned(),
            _ => {}
        }
    }
    ReplicationError::Server {
        context,
        code,
        message,
    }
}

/// Slot and publication names go into commands unquoted: allow only what
/// Postgres allows for slot names.
fn check_ident(name: &str) -> Result<(), ReplicationError> {
    if name.is_empty()
        || name.len() > 63
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Err(ReplicationError::Unsupported(format!(
            "name {name:?} must be 1 to 63 characters of lower-case letters, digits and underscores"
        )));
    }
    Ok(())
}
