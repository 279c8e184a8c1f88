//! The AdmissionReview as the handlers read it: the envelope and its objects, decoded into the
//! reduced pod types of [`crate::pods::admitted`] in one pass over the body ([`AdmittedReview`]).

use k8s_openapi::api::core::v1::{Binding, Pod};

use crate::error::{Error, Result};
use crate::pods::admitted::{AdmittedObject, AdmittedPod};
use crate::web::admission::ReviewRequest;

/// An AdmissionReview as the handlers read it: the envelope and its objects in one pass over the
/// body. When that pass fails (malformed JSON, a bad envelope, an object of an unexpected shape), the
/// envelope is parsed alone and each object is decoded when asked for, so requests the handler skips
/// are still skipped and errors keep their precise message ([`ReviewRequest::parse`],
/// [`ReviewRequest::object`]).
#[derive(Debug)]
pub struct AdmittedReview<'a> {
    /// The envelope.
    pub request: ReviewRequest<'a>,
    decoded: Option<Objects>,
}

/// `request.object` and `request.oldObject` decoded with the envelope (each taken when asked for).
type Objects = (Option<Box<AdmittedObject>>, Option<Box<AdmittedObject>>);

fn missing(field: &str) -> Error {
    Error::BadReview(format!("request.{field} is missing"))
}

impl<'a> AdmittedReview<'a> {
    /// Parse `body` (errors are [`Error::BadReview`], HTTP 400).
    pub fn parse(body: &'a [u8]) -> Result<Self> {
        match ReviewRequest::parse_decoded::<Box<AdmittedObject>>(body) {
            Ok(d) => Ok(AdmittedReview {
                request: d.request,
                decoded: Some((d.object, d.old_object)),
            }),
            Err(_) => Ok(AdmittedReview {
                request: ReviewRequest::parse(body)?,
                decoded: None,
            }),
        }
    }

    /// `request.object` as a pod (taken: a second call finds it missing). A pod without a namespace
    /// (a CREATE may leave it to the request's) gets the request's.
    ///
    /// Boxed, like the decoded objects: a k8s-openapi `Pod` is over 2 KB, and the handlers hold it
    /// across lookups, so inline it would be part of every handler future the server allocates and
    /// moves per review.
    pub fn pod(&mut self) -> Result<Box<Pod>> {
        let pod = match &mut self.decoded {
            Some((object, _)) => object
                .take()
                .map(|o| Box::new(o.into_pod()))
                .ok_or_else(|| missing("object"))?,
            None => Box::new(self.request.object::<AdmittedPod>()?.into_pod()),
        };
        Ok(self.in_request_namespace(pod))
    }

    /// `request.oldObject` as a pod (taken), its namespace defaulted as in [`AdmittedReview::pod`].
    pub fn old_pod(&mut self) -> Result<Box<Pod>> {
        let pod = match &mut self.decoded {
            Some((_, old)) => old
                .take()
                .map(|o| Box::new(o.into_pod()))
                .ok_or_else(|| missing("oldObject"))?,
            None => Box::new(self.request.old_object::<AdmittedPod>()?.into_pod()),
        };
        Ok(self.in_request_namespace(pod))
    }

    fn in_request_namespace(&self, mut pod: Box<Pod>) -> Box<Pod> {
        if pod.metadata.namespace.as_deref().is_none_or(str::is_empty)
            && !self.request.namespace.is_empty()
        {
            pod.metadata.namespace = Some(self.request.namespace.clone());
        }
        pod
    }

    /// `request.object` as a Binding (taken).
    pub fn binding(&mut self) -> Result<Binding> {
        match &mut self.decoded {
            Some((object, _)) => object
                .take()
                .ok_or_else(|| missing("object"))?
                .into_binding(),
            None => self.request.object::<Binding>(),
        }
    }

    /// Whether the objects were decoded with the envelope (false: the fallback path).
    pub fn single_pass(&self) -> bool {
        self.decoded.is_some()
    }
}
