//! The Join service: a one-time token and a CSR become a node certificate.

use crate::identity::{self};
use crate::proto::{join_server, JoinRequest, JoinResponse};
use crate::state::Shared;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub(crate) struct JoinService {
    pub(crate) shared: Arc<Shared>,
}

#[tonic::async_trait]
impl join_server::Join for JoinService {
    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinResponse>, Status> {
        let source = req
            .remote_addr()
            .map(|a| a.ip())
            .unwrap_or(std::net::Ipv4Addr::UNSPECIFIED.into());
        let req = req.into_inner();
        domain::valid_name("node id", &req.node_id).map_err(Status::invalid_argument)?;
        // Joins are rate-limited apart from sessions (each costs a
        // signature and a transaction): per address, per token, and only
        // tokens the region issued spend the gateway's joins.
        self.shared.admit_join(source, &req.token).await?;
        let mut client = self.shared.identity_db().await?;
        // The token and the node's id are checked before anything is signed.
        let (ca, validity) = (&self.shared.ca, self.shared.config.certificate_validity);
        let (pool, signed) =
            identity::redeem(&mut client, &req.token, &req.node_id, &req.csr_pem, || {
                ca.sign_node_for(&req.node_id, &req.csr_pem, validity)
            })
            .await
            .map_err(|e| {
                self.shared
                    .stats
                    .refused_joins
                    .fetch_add(1, Ordering::Relaxed);
                match e {
                    identity::IdentityError::BadToken
                    | identity::IdentityError::OtherNode(_)
                    | identity::IdentityError::NotAdmitted(_)
                    | identity::IdentityError::Revoked(_) => {
                        Status::permission_denied(e.to_string())
                    }
                    identity::IdentityError::Taken(_) => Status::already_exists(e.to_string()),
                    e => Status::unavailable(e.to_string()),
                }
            })?
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        self.shared.stats.joins.fetch_add(1, Ordering::Relaxed);
        // The node's session comes next, from the same address, with the
        // certificate it was just given: not held back as a stranger's.
        let handshakes = &self.shared.handshakes;
        handshakes.certified(source, handshakes.now_ms());
        tracing::info!(node = %req.node_id, %pool, serial = %signed.serial, "node joined");
        Ok(Response::new(JoinResponse {
            certificate_pem: signed.certificate_pem,
            ca_pem: self.shared.ca.cert_pem().to_string(),
            pool,
        }))
    }
}
