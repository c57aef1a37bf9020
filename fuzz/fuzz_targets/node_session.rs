//! A node session's messages off the wire: decoded, and an inventory
//! section in them turned into facts or refused, never a panic.
#![no_main]
use gateway::proto::{node_message, NodeMessage};
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    if let Ok(NodeMessage {
        body: Some(node_message::Body::Inventory(section)),
    }) = NodeMessage::decode(data)
    {
        let _ = gateway::inventory::section_facts("n1", section);
    }
});
