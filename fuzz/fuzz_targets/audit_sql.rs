//! The audit endpoint's statement splitter and control rules on arbitrary
//! text: every statement is a piece of the input, in order, and telling
//! what it does never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(sql) = std::str::from_utf8(data) else {
        return;
    };
    let base = sql.as_ptr() as usize;
    let mut end = 0;
    for stmt in audit::split::statements(sql) {
        let at = stmt.as_ptr() as usize - base;
        assert!(at >= end && at + stmt.len() <= sql.len());
        end = at + stmt.len();
        let _ = audit::control::classify(stmt);
    }
});
