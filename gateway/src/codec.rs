//! The protobuf codec with small buffers. tonic starts every stream's encode
//! and decode buffers at 8 KiB; a gateway holds one stream per node and most
//! messages are a few dozen bytes, so at 10,000 sessions that is 160 MiB of
//! mostly empty buffers. These start at 512 bytes and grow as needed.

use std::marker::PhantomData;
use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

const BUFFER: usize = 512;
const YIELD_THRESHOLD: usize = 32 * 1024;

#[derive(Debug, Clone)]
pub struct SmallCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for SmallCodec<T, U> {
    fn default() -> Self {
        SmallCodec(PhantomData)
    }
}

impl<T, U> Codec for SmallCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> ProstEncoder<T> {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::new(BUFFER, YIELD_THRESHOLD))
    }

    fn decoder(&mut self) -> ProstDecoder<U> {
        ProstCodec::<T, U>::raw_decoder(BufferSettings::new(BUFFER, YIELD_THRESHOLD))
    }
}
