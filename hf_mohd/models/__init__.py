"""Model families of hf-mohd. Every file here is remote code: it imports only torch, transformers and siblings."""
