// An S3-compatible server in memory for the recorder's S3 tests: gofakes3 (github.com/johannesboyne/gofakes3)
// with buckets made on first use, listening on the address given as the only argument.
package main

import (
	"log"
	"net/http"
	"os"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
)

func main() {
	s3 := gofakes3.New(s3mem.New(), gofakes3.WithAutoBucket(true))
	log.Fatal(http.ListenAndServe(os.Args[1], s3.Server()))
}
