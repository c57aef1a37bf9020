//! The pgoutput decoder on arbitrary bytes: the replication envelope, and
//! a logical message inside it; an error is fine, a panic is not.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = events::pgoutput::decode_replication(data);
    let _ = events::pgoutput::decode_logical(data);
});
